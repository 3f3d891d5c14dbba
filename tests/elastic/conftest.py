import pytest

from tests.rendezvous.rdzv_helpers import ServerProc

from .jobs import Job


@pytest.fixture
def server(tmp_path):
    srv = ServerProc(tmp_path, "--insecure", "--heartbeat-timeout", "2", "--settle", "0.2")
    yield srv
    srv.kill()


@pytest.fixture
def job_factory(tmp_path, server):
    jobs = []

    def make(**kw):
        job = Job(tmp_path, server.address, **kw)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()
