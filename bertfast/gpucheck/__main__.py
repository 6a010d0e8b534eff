from bertfast.gpucheck.runner import main

raise SystemExit(main())
