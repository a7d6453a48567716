"""``python -m arstream`` is the ``arstream`` command."""

import sys

from arstream.app.cli import main

sys.exit(main())
