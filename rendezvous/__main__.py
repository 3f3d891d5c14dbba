"""`python -m rendezvous` is `elastic-rendezvous`."""
import sys

from rendezvous.cli import main

sys.exit(main())
