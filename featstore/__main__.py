"""``python -m featstore ...``: the ``featstore`` command."""

import sys

from featstore.cli import main

if __name__ == "__main__":  # imported (the docs build reads every module): not run
    sys.exit(main())
