import pytest

from .launch_helpers import LaunchProc


@pytest.fixture
def launch(tmp_path):
    """launch(*launcher_args, command=None, prefix=(), launcher=..., cwd=..., **env) -> a running
    LaunchProc (see LaunchProc for the keywords); all are cleaned up after."""
    procs = []

    def make(*args, command=None, prefix=(), **kwargs):
        p = LaunchProc(tmp_path, *args, command=command, prefix=prefix, **kwargs)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.close()
