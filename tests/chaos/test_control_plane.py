"""Chaos on the control plane under a real training job: the rendezvous server killed and
restarted, the leading replica killed, etcd members (the leader too) lost. None of it may
change the world or stop a training step: the data plane does not need the control plane
while membership holds still."""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from rendezvous.client.status_client import StatusClient, StatusError
from tests.rendezvous.rdzv_helpers import ServerProc
from tests.waiting import wait_until

from .checks import EPOCHS, check_outcome
from .etcd_cluster import EtcdCluster

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane

WORKERS = ["w0", "w1", "w2"]
# Long enough (about 5 s of training) that every fault below lands mid-training.
STEP_SLEEP = "0.1"


@pytest.fixture
def cluster(tmp_path):
    (tmp_path / "etcd").mkdir()
    c = EtcdCluster(str(tmp_path / "etcd"), 3)
    yield c
    c.stop()


@pytest.fixture
def servers(tmp_path, cluster):
    """`servers()` starts one more rendezvous replica against the cluster (one etcd prefix per test)."""
    prefix = f"/chaos/{uuid.uuid4().hex[:8]}"
    started = []

    def start(port: int = 0) -> ServerProc:
        s = ServerProc(tmp_path, "--etcd", ",".join(cluster.endpoints), "--etcd-prefix", prefix, "--insecure",
                       "--heartbeat-timeout", "2", "--settle", "0.2", "--leader-ttl", "1", port=port)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


def leader_id(address: str):
    try:
        with StatusClient([address]) as status:
            return status.status(timeout_s=2).leader_id
    except StatusError:
        return None


def job_phase(address: str, job_id: str = "job"):
    with StatusClient([address]) as status:
        (job,) = status.status(job_id, timeout_s=5).jobs
    return job.phase


def steps_between(job, t0: float, t1: float) -> int:
    return sum(1 for w in WORKERS for e in job.events(w) if e["ev"] == "step" and t0 <= e["t"] <= t1)


def training(jobs, address: str, step: int):
    """The job on WORKERS (a world of exactly three) against `address`, once all reached `step`."""
    job = jobs(address, min_np=3, max_np=3, JOB_STEP_SLEEP=STEP_SLEEP)
    for w in WORKERS:
        job.start(w)
    job.wait_step(step, WORKERS)
    return job


def check_one_world(job, results) -> None:
    """Nothing changed the world: every step of every worker ran in the first world, never restored."""
    versions = {e["v"] for w in WORKERS for e in job.events(w) if e["ev"] == "step"}
    assert len(versions) == 1, f"the world changed: versions {sorted(versions)}"
    assert all(r["restores"] == 0 for r in results), [r["restores"] for r in results]


def test_server_killed_and_restarted_changes_no_world_and_stops_no_step(servers, jobs, fault_free_loss):
    first = servers()
    job = training(jobs, first.address, 6)
    killed_at = time.time()
    first.signal(signal.SIGKILL)
    first.kill()
    # The outage lasts until the workers have trained on without any server for a few steps.
    job.wait_step(job.progress("w0")[0] + 3, WORKERS, timeout=20)
    second = servers(port=first.port)  # same address: the workers reattach with backoff
    back_at = time.time()
    results = check_outcome(job, WORKERS, fault_free_loss=fault_free_loss, max_repartitions=2 * EPOCHS)
    check_one_world(job, results)
    assert steps_between(job, killed_at, back_at) >= 3 * len(WORKERS), "training must go on without a server"
    # The workers reattached to the new server and reported their success to it.
    assert job_phase(second.address) == "SUCCEEDED", second.log()


def test_leading_replica_killed_the_other_takes_over_without_changing_the_world(servers, jobs, fault_free_loss):
    a = servers()
    wait_until(lambda: leader_id(a.address), 15, "replica A to lead")
    b = servers()
    job = training(jobs, f"{a.address},{b.address}", 6)
    old_leader = leader_id(b.address)
    killed_at = time.time()
    a.signal(signal.SIGKILL)
    a.kill()
    wait_until(lambda: leader_id(b.address) not in (None, "", old_leader), 15, "replica B to lead")
    took_over_s = time.time() - killed_at
    results = check_outcome(job, WORKERS, fault_free_loss=fault_free_loss, max_repartitions=2 * EPOCHS)
    check_one_world(job, results)
    print(f"leader replica killed -> the other leads after {took_over_s:.2f} s")
    assert job_phase(b.address) == "SUCCEEDED", b.log()
    assert steps_between(job, killed_at, killed_at + took_over_s) >= 1, "training must go on during the failover"


def test_etcd_losing_a_member_then_its_leader_changes_no_world(cluster, servers, jobs, fault_free_loss):
    srv = servers()
    job = training(jobs, srv.address, 5)
    leader = cluster.leader()
    assert leader is not None
    # The server talks to the first endpoint (member 0) until it fails: lose that one first
    # when it is a follower, so the server must fail over to another member.
    follower = 0 if leader != 0 else 1
    cluster.kill(follower)               # 2 of 3 left: the cluster keeps its quorum
    job.wait_step(job.progress("w0")[0] + 3, WORKERS, timeout=20)
    cluster.start(follower)              # back with its data; it catches up from the leader
    cluster.wait(lambda: cluster.healthy(follower), 15, f"etcd member {follower} to rejoin")
    killed_at = time.time()
    cluster.kill(leader)                 # now the leader: the other two elect a new one
    # etcd elects within about a second (a 0.5 s election timeout); the margin is for a loaded machine.
    cluster.wait(lambda: cluster.leader() not in (None, leader), 30, "etcd to elect a new leader")
    print(f"etcd leader killed -> new etcd leader after {time.time() - killed_at:.2f} s")
    results = check_outcome(job, WORKERS, fault_free_loss=fault_free_loss, max_repartitions=2 * EPOCHS)
    check_one_world(job, results)
    assert job_phase(srv.address) == "SUCCEEDED", f"the server lost the job with etcd's leader: {srv.log()}"
