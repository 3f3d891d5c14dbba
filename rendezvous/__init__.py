"""elastic-ring's rendezvous service: membership decision, stores, gRPC server, worker client, CLI."""

from importlib import metadata as _metadata

try:
    # pyproject.toml is the one place that holds the version; every install (a wheel, an
    # sdist, `pip install -e .`) writes it into the distribution's metadata, read here.
    __version__ = _metadata.version("elastic-ring")
except _metadata.PackageNotFoundError:   # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
