import os

import pytest

from tests.elastic.conftest import job_factory, server  # noqa: F401  (the elastic tests' server and jobs)

JOB_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_job.py")


@pytest.fixture
def sharded_job(job_factory):  # noqa: F811
    """sharded_job(**kw) -> a Job of tests/sharded/sharded_job.py workers against the test's server."""
    def make(**kw):
        kw.setdefault("script", JOB_SCRIPT)
        return job_factory(**kw)
    return make
