"""`python -m elastic.launch`: the same as `elastic-run`."""

import sys

from . import main

sys.exit(main())
