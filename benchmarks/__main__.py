"""``python -m benchmarks --profile quick|full``."""

import sys

from .run import main

sys.exit(main())
