import sys

from hpcnft.cli.main import main

sys.exit(main())
