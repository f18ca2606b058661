"""``python -m fxzero``: the command line lives in :mod:`fxzero.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
