import sys

from lockstep.cli import main

sys.exit(main())
