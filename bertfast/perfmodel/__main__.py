import sys

from bertfast.perfmodel.report import main

sys.exit(main(sys.argv[1:]))
