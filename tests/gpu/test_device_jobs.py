"""Real elastic-run jobs whose DDP buckets, broadcasts and dist.all_reduce run on each world's
device communicator, gloo standing in for NCCL (ELASTIC_DEVICE_BACKEND=gloo): a communicator is
made for every world, on a store prefix of its own, and aborted on every kind of world change
(a SIGKILL, a hang, a respawn joining, a clean leave, a preemption); a worker whose abort never
returns exits with its own status and elastic-run respawns it. The same job runs on GPUs in
bench/gpu_check.py (bench/_gpu_worker.py is the job of both)."""

from __future__ import annotations

import os
import re
import signal
import sys
from typing import Dict, List, Tuple

import pytest

from tests.launch.launch_helpers import REPO, LaunchProc
from tests.waiting import wait_until

pytestmark = pytest.mark.slow   # real launchers, workers and rings

JOB = os.path.join(REPO, "bench", "_gpu_worker.py")
MADE = re.compile(r"^\[(\S+)\] INFO elastic: device backend gloo of world version (\d+) made .*store prefix (\S+)\)")
ABORTED = re.compile(r"^\[(\S+)\] INFO elastic: device backend gloo of world version (\d+) aborted in [0-9.]+ s \((.*)\)$")


@pytest.fixture
def launch(tmp_path):
    procs: List[LaunchProc] = []

    def make(*args: str, **env: str) -> LaunchProc:
        env = {"ELASTIC_DEVICE_BACKEND": "gloo", "GJ_OUT": str(tmp_path), "GJ_STEPS": "100000",
               "GJ_SLEEP": "0.05", **env}
        p = LaunchProc(tmp_path, "--host", "hA", *args, command=[sys.executable, JOB, "ddp"], **env)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.close()


def device_events(p: LaunchProc, worker: str) -> List[Tuple[str, int, str]]:
    """("made", version, prefix) and ("aborted", version, reason) of ``worker``, in its order."""
    out = []
    for line in list(p.stderr):
        m = MADE.match(line)
        if m and m.group(1) == worker:
            out.append(("made", int(m.group(2)), m.group(3)))
        m = ABORTED.match(line)
        if m and m.group(1) == worker:
            out.append(("aborted", int(m.group(2)), m.group(3)))
    return out


def check_every_world_aborted(p: LaunchProc, worker: str) -> Dict[int, str]:
    """Every communicator ``worker`` made was aborted before the next was made (and the last at
    the end); returns the reason of each abort by world version."""
    events = device_events(p, worker)
    made = [e for e in events if e[0] == "made"]
    assert made, f"{worker} made no device communicator:\n{p.text()}"
    reasons: Dict[int, str] = {}
    live = None
    for kind, version, what in events:
        if kind == "made":
            assert live is None, f"{worker} made world {version}'s communicator with world {live}'s alive: {events}"
            live = version
        else:
            assert version == live, f"{worker} aborted world {version}'s communicator, not the live one: {events}"
            reasons[version] = what
            live = None
    assert live is None, f"{worker} never aborted world {live}'s communicator: {events}"
    return reasons


def for_a_failure(reasons: Dict[int, str]) -> bool:
    """Some world's communicator was aborted for a failure: the ring's abort (a peer lost, the
    rendezvous' notice) or its own collective failing first (gloo saw the peer's socket close),
    not because the next world formed or the run ended."""
    return any(not (r.startswith("world version ") and r.endswith(" formed")) and r != "the ring was closed"
               for r in reasons.values())


def check_prefixes_new(p: LaunchProc, workers: List[str]) -> None:
    """Every rank of a world met under one prefix, and no two worlds shared one."""
    by_version: Dict[int, set] = {}
    for w in workers:
        for kind, version, prefix in device_events(p, w):
            if kind == "made":
                by_version.setdefault(version, set()).add(prefix)
    assert all(len(v) == 1 for v in by_version.values()), by_version
    prefixes = [next(iter(v)) for v in by_version.values()]
    assert len(set(prefixes)) == len(prefixes) >= 2, by_version


def steps_in(p: LaunchProc, size: int) -> int:
    rx = re.compile(rf"^\[\S+\] step \d+ size {size} loss")
    return sum(1 for line in list(p.stdout) if rx.match(line))


def wait_steps(p: LaunchProc, size: int, count: int, timeout: float = 60) -> None:
    start_count = steps_in(p, size)
    wait_until(lambda: steps_in(p, size) >= start_count + count, timeout,
               f"{count} more steps in a world of {size}:\n{p.text()}")


def final_states(p: LaunchProc) -> Dict[str, str]:
    rx = re.compile(r"^\[(\S+)\] state ([0-9a-f]{64}) step (\d+)$")
    return {m.group(1): m.group(2) + "@" + m.group(3) for m in map(rx.match, list(p.stdout)) if m}


def finish(p: LaunchProc, timeout: float = 90) -> None:
    p.finish()
    assert p.wait(timeout) == 0, p.text()
    states = final_states(p)
    assert len(set(states.values())) == 1, f"the ranks ended with different states: {states}\n{p.text()}"


def test_a_sigkill_aborts_the_worlds_communicator_and_the_respawn_gets_a_fresh_one(launch):
    p = launch("--np", "3", "--min-np", "2", "--max-restarts", "1")
    p.wait_for(r"world \d+: 3 worker\(s\)", 90)
    wait_steps(p, 3, 6)
    p.kill_worker("hA-2")
    p.wait_for(r"world \d+: 2 worker\(s\); left: hA-2", 30)
    wait_steps(p, 2, 4)
    p.wait_for(r"world \d+: 3 worker\(s\); joined: hA-2-r1", 90)
    wait_steps(p, 3, 6)
    finish(p)
    for survivor in ("hA-0", "hA-1"):
        reasons = check_every_world_aborted(p, survivor)
        assert len(reasons) >= 3, reasons   # the world of 3, of 2, of 3 again
        assert for_a_failure(reasons), reasons   # the SIGKILL
        assert list(reasons.values())[-1] == "the ring was closed"
    check_every_world_aborted(p, "hA-2-r1")
    check_prefixes_new(p, ["hA-0", "hA-1", "hA-2-r1"])
    p.wait_no_leftovers()


def test_a_hung_peer_times_out_the_device_collective_and_the_world_reforms_without_it(launch):
    # hA-2 stops (SIGSTOP) while alive: the others' collective on the device communicator never
    # completes; the collective timeout blames the next rank, the rendezvous probes it (stopped:
    # no answer) and evicts it, and the survivors' communicator is aborted.
    p = launch("--np", "3", "--min-np", "2", "--max-restarts", "0", ELASTIC_COLLECTIVE_TIMEOUT="3")
    p.wait_for(r"world \d+: 3 worker\(s\)", 90)
    wait_steps(p, 3, 6)
    pid = p.worker_pid("hA-2")
    os.kill(pid, signal.SIGSTOP)
    try:
        p.wait_for(r"world \d+: 2 worker\(s\); left: hA-2", 60)
        wait_steps(p, 2, 4)
    finally:
        os.kill(pid, signal.SIGKILL)
    p.wait_for(r"hA-2 .*killed by SIGKILL; not respawned", 30)   # the launcher saw it go before the job ends
    finish(p)
    for survivor in ("hA-0", "hA-1"):
        reasons = check_every_world_aborted(p, survivor)
        assert for_a_failure(reasons), reasons   # the hang
    check_prefixes_new(p, ["hA-0", "hA-1"])
    p.wait_no_leftovers()


def test_a_clean_leave_and_a_preemption_each_end_the_worlds_communicator(launch):
    # hA-2 asks to leave at step 8 (elastic.request_leave), then hA-1 is preempted (SIGTERM):
    # worlds of 3, 2 and 1, each with a communicator of its own, each aborted as it ended.
    p = launch("--np", "3", "--min-np", "1", "--max-restarts", "0", GJ_LEAVE="hA-2:8")
    p.wait_for(r"world \d+: 2 worker\(s\); left: hA-2", 90)
    wait_steps(p, 2, 4)
    p.kill_worker("hA-1", signal.SIGTERM)
    p.wait_for(r"world \d+: 1 worker\(s\); left: hA-1", 60)
    wait_steps(p, 1, 3)
    finish(p)
    reasons = check_every_world_aborted(p, "hA-0")
    assert len(reasons) >= 3, reasons
    for leaver in ("hA-2", "hA-1"):
        check_every_world_aborted(p, leaver)   # its last world's too, as it left
    check_prefixes_new(p, ["hA-0", "hA-1", "hA-2"])
    p.wait_no_leftovers()


def test_a_worker_whose_abort_never_returns_exits_with_its_status_and_is_respawned(launch):
    # hA-2's first incarnation gets a backend whose abort() sleeps an hour. hA-1 is killed: every
    # survivor aborts its communicator; hA-2's does not return within 2 s, so it writes one line
    # and exits with status 75, and elastic-run respawns both. The job goes on, back to 3.
    p = launch("--np", "3", "--min-np", "1", "--max-restarts", "1", GJ_STUCK_ABORT="2",
               ELASTIC_DEVICE_ABORT_TIMEOUT="2")
    p.wait_for(r"world \d+: 3 worker\(s\)", 90)
    wait_steps(p, 3, 6)
    p.kill_worker("hA-1")
    p.wait_for(r"^\[hA-2\] elastic: aborting the gloo communicator of world version \d+ did not return within "
               r"2 s \(ELASTIC_DEVICE_ABORT_TIMEOUT\); this worker exits with status 75 to be replaced$", 30)
    p.wait_for(r"hA-2.*exited with status 75 \(the abort of its device communicator did not return\)", 30)
    p.wait_for(r"world \d+: 3 worker\(s\); joined: ", 90)   # both respawns in (3 only with both)
    wait_steps(p, 3, 6)
    finish(p)
    assert set(final_states(p)) == {"hA-0", "hA-1-r1", "hA-2-r1"}, final_states(p)
    check_every_world_aborted(p, "hA-0")
    p.wait_no_leftovers()


def test_every_collective_of_the_elastic_group_gives_torchs_answer_on_the_device_communicator(tmp_path):
    p = LaunchProc(tmp_path, "--host", "hA", "--np", "3", command=[sys.executable, JOB, "collectives"],
                   ELASTIC_DEVICE_BACKEND="gloo", GJ_OUT=str(tmp_path))
    try:
        assert p.wait(120) == 0, p.text()
        lines = [line for line in p.stdout if " collectives " in line]
        assert len(lines) == 3 and all(" collectives ok rank " in line for line in lines), p.text()
        assert len([line for line in p.stderr if MADE.match(line)]) == 3, p.text()   # it ran on gloo
    finally:
        p.close()
