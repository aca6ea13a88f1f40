"""``python -m torchstash``: the ``torchstash`` command."""

import sys

from .cli import main

sys.exit(main())
