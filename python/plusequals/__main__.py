"""``python -m plusequals demo | report | summary``: see :mod:`plusequals.cli`."""

import sys

from .cli import main

sys.exit(main())
