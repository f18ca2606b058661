"""``python -m fxzero``: the command line lives in :mod:`fxzero.debug.cli`."""

import sys

from .debug.cli import main

if __name__ == "__main__":
    sys.exit(main())
