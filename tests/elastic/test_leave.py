"""Graceful leave on real processes: SIGTERM (or elastic.request_leave()) makes a worker leave at
its next commit; the world shrinks there and the survivors keep their state. A worker whose
commit boundary does not come within the grace leaves as a failure instead."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from elastic.runtime.preemption import REPEAT_WINDOW_S, insists
from rendezvous.client.status_client import StatusClient
from tests.chaos.checks import EPOCHS, check_accounting, check_identical, check_no_commit_lost
from tests.native import wire

from .jobs import wait_until


def steps_of(job, worker):
    return [e["step"] for e in job.events(worker) if e["ev"] == "step"]


def check_nothing_redone(job, survivors):
    """Every survivor's steps only go forward: none was trained twice (nothing restored)."""
    for w in survivors:
        steps = steps_of(job, w)
        assert steps == sorted(set(steps)), f"{w} redid steps: {steps}"
        assert not [e for e in job.events(w) if e["ev"] == "restore"], f"{w} restored a commit"


def check_left_at_one_commit(job, leaver, survivors):
    """The leaver left at the commit where every survivor switched worlds, and ran none after it."""
    left = [e for e in job.events(leaver) if e["ev"] == "left"]
    assert len(left) == 1, job.log(leaver)
    commit = left[0]["commit"]
    for w in survivors:
        assert commit in job.result(w)["commits_at_change"], (commit, job.result(w)["commits_at_change"])
    assert max(e["commit"] for e in job.events(leaver) if e["ev"] == "commit") == commit
    return left[0]


def shrunk_at(job, survivors, size, after):
    """Time of the first step any survivor completed in a world of ``size`` after ``after``."""
    times = [e["t"] for w in survivors for e in job.events(w)
             if e["ev"] == "step" and e["size"] == size and e["t"] > after]
    return min(times) if times else None


@pytest.mark.slow
def test_sigterm_mid_epoch_shrinks_the_world_at_the_next_commit_without_a_restore(job_factory):
    job = job_factory(min_np=2, max_np=3, JOB_STEP_SLEEP="0.1")
    workers = ["w0", "w1", "w2"]
    for w in workers:
        job.start(w)
    job.wait_step(6, workers)
    sent = time.time()
    job.kill("w2", signal.SIGTERM)
    assert job.wait(["w2"], timeout=30) == {"w2": 0}, job.log("w2")
    survivors = ["w0", "w1"]
    assert job.wait(survivors) == {w: 0 for w in survivors}
    # A commit every 3 steps of 0.1 s: the smaller world trains within a commit interval and the
    # form/settle time, far below a failure's restore and heartbeat timeout.
    took = shrunk_at(job, survivors, 2, sent) - sent
    assert took < 3 * 0.1 + 1.5, f"the world shrank {took:.2f} s after SIGTERM"
    check_left_at_one_commit(job, "w2", survivors)
    check_nothing_redone(job, survivors)
    results = [job.result(w) for w in survivors]
    assert all(r["restores"] == 0 and r["final_size"] == 2 for r in results)
    check_identical(results)
    check_accounting(results, max_repartitions=2 * (EPOCHS + 2))
    check_no_commit_lost({w: job.events(w) for w in workers})
    assert "left job job gracefully (SIGTERM)" in job.log("w2")
    assert "restoring commit" not in job.log("w0") + job.log("w1")


@pytest.mark.slow
def test_request_leave_shrinks_the_world_like_sigterm(job_factory):
    job = job_factory(min_np=2, max_np=3, JOB_STEP_SLEEP="0.05", JOB_LEAVE_AT="w1:8")
    workers = ["w0", "w1", "w2"]
    for w in workers:
        job.start(w)
    codes = job.wait(workers)
    assert codes == {w: 0 for w in workers}, {w: job.log(w) for w in workers}
    survivors = ["w0", "w2"]
    left = check_left_at_one_commit(job, "w1", survivors)
    assert left["step"] >= 8
    check_nothing_redone(job, survivors)
    results = [job.result(w) for w in survivors]
    assert all(r["restores"] == 0 and r["final_size"] == 2 for r in results)
    check_identical(results)
    assert "left job job gracefully (the test asked)" in job.log("w1")


def check_no_member(status, worker):
    """``worker`` is no member of the job on the server (or the job is gone)."""
    view = status.job("job", timeout_s=2.0)
    assert view is None or not any(m.worker_id == worker for m in view.members), view


@pytest.mark.slow
def test_sigterm_while_waiting_for_a_world_leaves_at_once(job_factory, server):
    # min-np 2 with one worker: it waits for a world that never comes, and holds no ring.
    job = job_factory(min_np=2, max_np=2)
    job.start("w0")
    status = StatusClient([server.address])
    try:
        wait_until(lambda: (lambda v: v is not None and any(m.worker_id == "w0" and m.attached for m in v.members))(
            status.job("job", timeout_s=2.0)), 30, "w0 to join and wait")
        job.kill("w0", signal.SIGTERM)
        assert job.wait(["w0"], timeout=15) == {"w0": 0}, job.log("w0")
        assert "left job job gracefully (SIGTERM)" in job.log("w0")
        # It told the server: gone from the job at once, not evicted after a heartbeat timeout.
        check_no_member(status, "w0")
    finally:
        status.close()


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (the kernel's SigCgt mask)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (int(sig) - 1) & 1)


@pytest.mark.slow
def test_sigterm_while_joining_leaves_once_the_server_answers(job_factory, server):
    # The server is stopped: w0's Join cannot be answered. The SIGTERM comes while it waits, and
    # must be a leave (told to the server once it answers), not the death of a member just admitted.
    job = job_factory(min_np=2, max_np=2)
    server.signal(signal.SIGSTOP)
    try:
        pid = job.start("w0").pid
        wait_until(lambda: catches(pid, signal.SIGTERM), 25, "w0 to catch SIGTERM before its Join is answered")
        job.kill("w0", signal.SIGTERM)
    finally:
        server.signal(signal.SIGCONT)
    assert job.wait(["w0"], timeout=30) == {"w0": 0}, job.log("w0")
    assert "left job job gracefully (SIGTERM) at commit -1 (none made yet) of world version 0" in job.log("w0")
    status = StatusClient([server.address])
    try:
        check_no_member(status, "w0")
    finally:
        status.close()


@pytest.mark.slow
def test_sigterm_while_no_server_answers_the_join_leaves_at_once(job_factory):
    # Nothing listens at the rendezvous address: the Join is retried until its 30 s deadline, and
    # the grace is 30 s. A SIGTERM meanwhile ends it after the attempt under way, with exit 0.
    job = job_factory(min_np=2, max_np=2, ELASTIC_RENDEZVOUS=wire.closed_port_address())
    pid = job.start("w0").pid
    wait_until(lambda: catches(pid, signal.SIGTERM), 25, "w0 to catch SIGTERM while it joins")
    signalled = time.monotonic()
    job.kill("w0", signal.SIGTERM)
    assert job.wait(["w0"], timeout=15) == {"w0": 0}, job.log("w0")
    print(f"SIGTERM -> exit of a worker no server answers: {time.monotonic() - signalled:.2f} s")
    log = job.log("w0")
    assert "worker w0 left job job gracefully (SIGTERM) before any server answered its join" in log, log
    assert "Join for job job worker w0: given up after" in log, log


@pytest.mark.slow
def test_a_leaver_that_reaches_no_commit_within_the_grace_leaves_as_a_failure(job_factory):
    # w2 stalls 6 s inside a step; SIGTERM arrives during the stall and the grace is 1 s.
    job = job_factory(min_np=2, max_np=3, JOB_STEP_SLEEP="0.05", ELASTIC_PREEMPT_GRACE="1",
                      JOB_STALL="w2:10:6")
    workers = ["w0", "w1", "w2"]
    for w in workers:
        job.start(w)
    wait_until(lambda: any(e["ev"] == "stall" for e in job.events("w2")), 60, "w2 to stall")
    job.kill("w2", signal.SIGTERM)
    codes = job.wait(["w2"], timeout=20)
    assert codes == {"w2": 143}, job.log("w2")
    assert "reached no commit boundary within 1 s (ELASTIC_PREEMPT_GRACE): leaving as a failure" in job.log("w2")
    survivors = ["w0", "w1"]
    assert job.wait(survivors) == {w: 0 for w in survivors}
    results = [job.result(w) for w in survivors]
    assert all(r["restores"] + r["kept"] >= 1 and r["final_size"] == 2 for r in results)   # restored or kept
    check_identical(results)
    check_no_commit_lost({w: job.events(w) for w in workers})


# ---------------------------------------------------------------------- the request and its grace, in-process
def test_the_grace_runs_out_once_from_the_first_request():
    from elastic.runtime.preemption import LeaveRequest

    expired = []
    req = LeaveRequest(0.3, "w", expire=expired.append)
    assert not req.pending
    started = time.monotonic()
    req.request("SIGTERM")
    req.request("again")   # later requests change nothing
    wait_until(lambda: expired, 5, "the grace to run out")
    assert time.monotonic() - started >= 0.3
    assert req.why == "SIGTERM" and "(SIGTERM) and reached no commit boundary within 0.3 s" in expired[0]
    assert len(expired) == 1


@pytest.mark.slow
def test_a_finished_request_does_not_expire():
    from elastic.runtime.preemption import LeaveRequest

    expired = []
    req = LeaveRequest(0.2, "w", expire=expired.append)
    req.request("SIGTERM")
    req.finish()   # left in time
    assert not req.pending
    time_out = time.monotonic() + 0.6
    wait_until(lambda: time.monotonic() > time_out, 2, "past the grace")
    assert expired == []


@pytest.mark.parametrize("signum, after, ends", [
    (15, 0.05, False),                     # Slurm's and the launcher's SIGTERM: one request
    (15, REPEAT_WINDOW_S - 0.01, False),
    (15, REPEAT_WINDOW_S, True),            # later, the sender insists
    (2, 0.05, True),                       # Ctrl-C twice still interrupts at once
])
def test_a_repeated_sigterm_within_the_window_is_the_same_request(signum, after, ends):
    assert insists(signum, 100.0, 100.0 + after) is ends


# A worker that left on SIGTERM, its handlers put back, and the repeat of that SIGTERM (Slurm's copy
# or elastic-run's) after it: run in a real process that signals itself. PROLOGUE leaves on the
# first SIGTERM as elastic.run does; each case then says what comes next and prints what survived.
# ``last`` runs after every other atexit function, elastic's included (registered before its import).
PROLOGUE = """
import atexit, os, signal, sys, time
# Python's own SIGINT handler, as a program started from a terminal has it: one started where
# SIGINT is ignored (a background job of a script, as a CI runner may start the suite) inherits
# SIG_IGN, and Python then installs none.
signal.signal(signal.SIGINT, signal.default_int_handler)
last = []
atexit.register(lambda: [f() for f in last])
from elastic.runtime import preemption
asked = []
installed = preemption.install_handlers(asked.append)
os.kill(os.getpid(), signal.SIGTERM)
assert asked == ["SIGTERM"], asked
"""
AFTER_LEAVING = {
    # The repeat within the window, after the run ended: the same request, absorbed.
    "repeat-within-window": """
preemption.restore_handlers(installed)
os.kill(os.getpid(), signal.SIGTERM)
print("alive")
""",
    # Past the window a SIGTERM insists: the default action, as before the run.
    "repeat-past-window": """
preemption.REPEAT_WINDOW_S = 0.05
preemption.restore_handlers(installed)
time.sleep(0.1)   # time itself is what this waits for: past the window
os.kill(os.getpid(), signal.SIGTERM)
print("alive")
""",
    # The repeat at the very end of the exit, when Python is about to put the default action back.
    "repeat-while-exiting": """
def repeat():
    print("ignored at exit", signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    print("alive at exit", flush=True)
last.append(repeat)
preemption.restore_handlers(installed)
""",
    # A handler the program installs afterwards and that passes signals on to the one it replaced
    # (as libraries do): within the window the repeat stops there; the program's handler stays.
    "chained-by-a-later-handler": """
preemption.restore_handlers(installed)
replaced = signal.getsignal(signal.SIGTERM)
got = []
signal.signal(signal.SIGTERM, lambda s, f: (got.append(s), replaced(s, f)))
os.kill(os.getpid(), signal.SIGTERM)
print("alive", got == [signal.SIGTERM], signal.getsignal(signal.SIGTERM) is not replaced)
""",
    # A second run in the same process: the first run's repeat is not a new request, nor wrapped twice.
    "a-second-run": """
preemption.restore_handlers(installed)
again = []
second = preemption.install_handlers(again.append)
os.kill(os.getpid(), signal.SIGTERM)
print("alive", again == [], second.previous[signal.SIGTERM] is signal.SIG_DFL)
""",
    # SIGINT is never absorbed: after a Ctrl-C leave, Python's handler is back and raises at once.
    "sigint-after": """
os.kill(os.getpid(), signal.SIGINT)
assert asked == ["SIGTERM", "SIGINT"], asked
preemption.restore_handlers(installed)
try:
    os.kill(os.getpid(), signal.SIGINT)
    print("not raised")
except KeyboardInterrupt:
    print("KeyboardInterrupt")
""",
}


@pytest.mark.slow
@pytest.mark.parametrize("case, code, says", [
    ("repeat-within-window", 0, "alive"),
    ("repeat-past-window", -signal.SIGTERM, ""),
    ("repeat-while-exiting", 0, "ignored at exit True\nalive at exit"),
    ("chained-by-a-later-handler", 0, "alive True True"),
    ("a-second-run", 0, "alive True True"),
    ("sigint-after", 0, "KeyboardInterrupt"),
])
def test_the_repeat_of_the_sigterm_a_worker_left_on_does_not_kill_it_after_it_left(case, code, says):
    p = subprocess.run([sys.executable, "-c", PROLOGUE + AFTER_LEAVING[case]], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == code, p.stderr
    assert p.stdout.strip() == says, p.stdout + p.stderr


@pytest.mark.parametrize("raw, message", [
    ("0", "ELASTIC_PREEMPT_GRACE=0 must be positive"),
    ("-1", "ELASTIC_PREEMPT_GRACE='-1' must not be negative"),
    ("soon", "ELASTIC_PREEMPT_GRACE='soon' is not a valid float"),
])
def test_a_bad_preempt_grace_is_refused_naming_the_variable(raw, message):
    from elastic.runtime.worker_config import WorkerConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        WorkerConfig.from_env({"ELASTIC_RENDEZVOUS": "127.0.0.1:1", "ELASTIC_PREEMPT_GRACE": raw})
    assert WorkerConfig.from_env({"ELASTIC_RENDEZVOUS": "127.0.0.1:1"}).preempt_grace == 30.0
