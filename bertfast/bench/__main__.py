import sys

from bertfast.bench.cli import main

sys.exit(main(sys.argv[1:]))
