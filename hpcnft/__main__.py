import sys

from hpcnft.cli import main

sys.exit(main())
