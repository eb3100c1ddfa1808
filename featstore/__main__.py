"""``python -m featstore ...``: the ``featstore`` command."""

import sys

from featstore.cli._main import main

sys.exit(main())
