"""Fixtures for the chaos scenarios: a rendezvous server process, the training job, its fault-free loss."""

from __future__ import annotations

import pytest

from tests.rendezvous.rdzv_helpers import ServerProc
from tests.elastic.conftest import server  # noqa: F401  (the same in-memory server, heartbeat timeout 2 s)
from tests.elastic.jobs import Job

# Every scenario waits at most this long for its job; together they stay well inside CI's budget.
JOB_TIMEOUT_S = 120


@pytest.fixture
def jobs(tmp_path):
    """`jobs(server_address, **Job kwargs)`: training jobs closed (every process killed) at the end."""
    made = []

    def make(address, **kw):
        kw.setdefault("subdir", None)
        out = tmp_path / (kw.pop("subdir") or f"job{len(made)}")
        out.mkdir()
        job = Job(out, address, **kw)
        made.append(job)
        return job

    yield make
    for job in made:
        job.close()


@pytest.fixture(scope="session")
def fault_free_loss(tmp_path_factory):
    """Final loss of the job run without faults (3 workers), to compare each scenario with."""
    tmp = tmp_path_factory.mktemp("fault-free")
    srv = ServerProc(tmp, "--insecure", "--heartbeat-timeout", "2", "--settle", "0.2")
    job = Job(tmp, srv.address, min_np=3, max_np=3)
    try:
        workers = ["f0", "f1", "f2"]
        for w in workers:
            job.start(w)
        assert job.wait(workers, JOB_TIMEOUT_S) == {w: 0 for w in workers}
        losses = {job.result(w)["loss"] for w in workers}
        assert len(losses) == 1, losses
        return losses.pop()
    finally:
        job.close()
        srv.kill()
