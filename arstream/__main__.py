"""``python -m arstream`` is the ``arstream`` command."""

import sys

from arstream.cli import main

sys.exit(main())
