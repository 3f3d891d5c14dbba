"""One real Slurm cluster (slurmctld and four slurmd, each node a namespace) for the tests here."""

from __future__ import annotations

import pytest

from .cluster import SlurmCluster, skip_reason


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm")), nodes=4)
    yield cluster
    cluster.close()


@pytest.fixture
def slurm(slurm_cluster, request):
    """The cluster with every node up and idle and no job left, as each test starts."""
    slurm_cluster.heal()
    yield slurm_cluster
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        print(slurm_cluster.logs())


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
