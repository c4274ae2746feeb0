import sys

from verl_fast.cli import main

sys.exit(main())
