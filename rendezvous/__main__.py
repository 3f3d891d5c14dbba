"""`python -m rendezvous` is `elastic-rendezvous`."""
import sys

from .cli import main

sys.exit(main())
