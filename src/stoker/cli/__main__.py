"""``python -m stoker.cli``: the same as the ``stoker`` console script."""

import sys

from . import main

sys.exit(main())
