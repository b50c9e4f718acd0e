import sys

from batchd.cli import main

sys.exit(main())
