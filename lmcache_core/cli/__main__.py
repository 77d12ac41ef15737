"""``python -m lmcache_core.cli``: the same as the ``lmcache-core`` console script."""

import sys

from .main import main

sys.exit(main())
