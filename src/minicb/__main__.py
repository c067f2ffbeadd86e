"""``python -m minicb ...`` is the ``minicb`` command."""

import sys

from minicb.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
