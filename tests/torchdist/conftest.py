import pytest

from tests.elastic.conftest import job_factory, server  # noqa: F401  (the runtime tests' server and jobs)

from . import JOB_SCRIPT


@pytest.fixture
def ddp_job(job_factory):  # noqa: F811
    """ddp_job(**kw) -> a Job of tests/torchdist/ddp_job.py workers against the test's server."""
    def make(**kw):
        kw.setdefault("script", JOB_SCRIPT)
        return job_factory(**kw)
    return make
