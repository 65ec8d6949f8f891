import sys

from raytuner.cli import main

sys.exit(main())
