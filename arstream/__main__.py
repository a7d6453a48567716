"""``python -m arstream`` is the ``arstream`` command."""

import sys

from .cli import main

sys.exit(main())
