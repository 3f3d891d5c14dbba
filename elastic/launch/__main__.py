"""`python -m elastic.launch`: the same as `elastic-run`."""

import sys

from elastic.launch import main

sys.exit(main())
