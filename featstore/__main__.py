"""``python -m featstore ...``: the ``featstore`` command."""

import sys

from .cli import main

sys.exit(main())
