import sys

from dlrm.cli import main

sys.exit(main())
