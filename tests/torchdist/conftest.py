import pytest

from tests.rendezvous.rdzv_helpers import ServerProc
from tests.runtime.jobs import Job

from . import JOB_SCRIPT


@pytest.fixture
def server(tmp_path):
    srv = ServerProc(tmp_path, "--insecure", "--heartbeat-timeout", "2", "--settle", "0.2")
    yield srv
    srv.kill()


@pytest.fixture
def ddp_job(tmp_path, server):
    jobs = []

    def make(**kw):
        kw.setdefault("script", JOB_SCRIPT)
        job = Job(tmp_path, server.address, **kw)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.close()
