import pytest

from .launch_helpers import LaunchProc


@pytest.fixture
def launch(tmp_path):
    """launch(*launcher_args, command=None, prefix=(), **env) -> a running LaunchProc; all are cleaned up after."""
    procs = []

    def make(*args, command=None, prefix=(), **env):
        p = LaunchProc(tmp_path, *args, command=command, prefix=prefix, **env)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.close()
