"""`python -m loadtest ARGS...`, the same as `kvgate bench ARGS...`."""

import sys

from loadtest.cli import main

sys.exit(main())
