"""Durable commits off the training thread: a commit hands its snapshot to the State's writer
and goes on; the file holds exactly the state of its commit although later commits reuse the
buffers; a commit waits (and says so) only for a write still running, and never long enough
for the other ranks to take it for dead; a failed write is logged and the next one retried;
the write in flight is finished when elastic.run returns and when the process exits."""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import elastic
from elastic.state import checkpoint
from elastic.runtime import collectives
from elastic.ring import serialization

from tests.waiting import wait_until

from .jobs import REPO

def commit_file(directory, commit: int) -> str:
    """The durable commit file of ``commit`` in ``directory``, whatever training step its name shows."""
    found = [n for n in os.listdir(directory) if re.fullmatch(rf"elastic-commit-{commit:012d}(-[a-z0-9-]+)?\.ckpt", n)]
    assert len(found) == 1, (commit, sorted(os.listdir(directory)))
    return os.path.join(str(directory), found[0])



def solo_ring(timeout: float = 30.0) -> elastic.Communicator:
    return elastic.Communicator.form(listener=None, job_id="solo", secret=b"s", world_version=1, rank=0,
                                     peers=["127.0.0.1:1"], config=elastic.CommConfig(timeout=timeout))


@pytest.fixture
def solo():
    """A real communicator of one rank, current for the module-level collectives."""
    comm = solo_ring()
    collectives.set_communicator(comm)
    yield comm
    collectives.set_communicator(None)
    comm.close()


class HeldDisk:
    """The writer's ``write_file`` for a test: the real write to the real directory, held back
    until ``release()`` (a disk as slow as the test needs), counting the writes started."""

    def __init__(self):
        self.gate = threading.Event()
        self.started = []
        self._write = checkpoint.write

    def __call__(self, directory, step, snapshot, position=""):
        self.started.append(step)
        if not self.gate.wait(60):
            raise AssertionError("the test never released the held disk")
        return self._write(directory, step, snapshot, position)

    def release(self):
        self.gate.set()


@pytest.fixture
def held(monkeypatch):
    disk = HeldDisk()
    monkeypatch.setattr(checkpoint.DurableWriter, "write_file", staticmethod(disk))
    yield disk
    disk.release()  # a writer still waiting ends its write before the next test


def make_state(directory, every):
    state = elastic.ObjectState(epoch=0, w=torch.zeros(1 << 16), counts=torch.zeros(7, dtype=torch.int64),
                                noise=np.zeros(3), name="start")
    state.enable_durable_commits(str(directory), every)
    return state


def advance(state, i):
    """Changes every part of the state in place, as a training step does."""
    state.epoch = i
    state.w.add_(float(i) + 0.25)
    state.counts[i % 7] += i
    state.noise = np.full(3, float(i))
    state.name = f"commit {i}"


def payload_of(path):
    """The serialized state inside a durable commit file, as bytes (header and digest cut off)."""
    data = open(path, "rb").read()
    return data[28:-32]


def timed_commit(state):
    started = time.monotonic()
    state.commit()
    return time.monotonic() - started


# --------------------------------------------------------------------------- the hazard
def test_the_file_holds_exactly_its_commit_while_later_commits_reuse_the_buffers(solo, tmp_path, held):
    # Durable every 5th commit: commit 0 is written while commits 1-4 are taken, and commit 2
    # is the one whose copy would go into commit 0's buffers (double buffering), the very
    # buffers the writer has not read yet.
    state = make_state(tmp_path / "ckpt", every=5)
    advance(state, 0)
    expected = serialization.dumps(state.live())  # bytes, copied now: the state of commit 0
    state.commit()
    assert state._writer.pending() == 0, "commit 0 is still being written"
    for i in range(1, 5):
        advance(state, i)
        state.commit()
    last = serialization.dumps(state.live())
    held.release()
    assert state.finish_durable_commits(10)
    path = commit_file(tmp_path / "ckpt", 0)
    assert payload_of(path) == expected, "the file must hold commit 0 bit for bit, not a later commit"
    step, back = checkpoint.read_file(path)
    assert step == 0 and back["attrs"]["name"] == "commit 0"
    # And the in-memory commits went on untouched: restoring gives commit 4.
    advance(state, 99)
    state.restore()
    assert serialization.dumps(state.live()) == last and state.commit_step == 4


def test_a_durable_commit_on_a_slow_disk_returns_without_waiting_for_it(solo, tmp_path, held):
    state = make_state(tmp_path / "ckpt", every=1)
    advance(state, 0)
    took = timed_commit(state)
    assert state._writer.pending() == 0, "the write is still held back, so the commit did not wait for it"
    assert took < 1.0, f"commit() took {took:.2f} s with the disk held: it waited for the write"
    held.release()
    assert state.finish_durable_commits(10)
    assert checkpoint.read_latest(str(tmp_path / "ckpt"))[0] == 0


# --------------------------------------------------------------------------- waiting
@pytest.mark.slow
def test_a_commit_that_finds_the_previous_write_running_waits_for_it_and_says_how_long(solo, tmp_path, held,
                                                                                       caplog):
    state = make_state(tmp_path / "ckpt", every=2)
    advance(state, 0)
    state.commit()  # durable commit 0: held
    advance(state, 1)
    assert timed_commit(state) < 1.0  # commit 1 is not durable: no wait at all
    advance(state, 2)
    expected = serialization.dumps(state.live())
    threading.Timer(0.5, held.release).start()
    with caplog.at_level(logging.WARNING, logger="elastic"):
        took = timed_commit(state)  # durable commit 2: waits for commit 0's write
    assert took >= 0.45, f"commit 2 returned after {took:.2f} s, before the write of commit 0 ended"
    lines = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("durable commit 2 waited 0.") and \
        "for the write of commit 0" in lines[0], lines
    assert state.finish_durable_commits(10)
    assert payload_of(commit_file(tmp_path / "ckpt", 2)) == expected


@pytest.mark.slow
def test_a_write_running_past_half_the_collective_timeout_leaves_that_commit_unwritten(tmp_path, held, caplog):
    # Waiting longer would leave the other ranks, in the boundary's allreduce, blaming this one.
    comm = solo_ring(timeout=1.0)
    collectives.set_communicator(comm)
    try:
        state = make_state(tmp_path / "ckpt", every=2)
        advance(state, 0)
        state.commit()
        advance(state, 1)
        state.commit()
        advance(state, 2)
        in_memory = serialization.dumps(state.live())
        with caplog.at_level(logging.WARNING, logger="elastic"):
            took = timed_commit(state)
        assert 0.45 <= took < 0.9, f"commit 2 waited {took:.2f} s; half the collective timeout is 0.5 s"
        assert "durable commit 2 not written: the write of commit 0" in caplog.text
        assert "still running after 0.5 s" in caplog.text
        assert state.commit_step == 2
        advance(state, 50)
        state.restore()
        assert serialization.dumps(state.live()) == in_memory, "the in-memory commit stands"
        held.release()
        advance(state, 3)
        state.commit()
        advance(state, 4)
        state.commit()  # the next durable commit is written
        assert state.finish_durable_commits(10)
        assert checkpoint.read_latest(str(tmp_path / "ckpt"))[0] == 4
    finally:
        collectives.set_communicator(None)
        comm.close()


# --------------------------------------------------------------------------- failures
@pytest.fixture
def small_fs(tmp_path):
    """A real filesystem of 256 KiB (tmpfs), mounted under tmp_path: a disk that fills up."""
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def remount(mount, options):
    subprocess.run(["mount", "-o", f"remount,{options}", str(mount)], check=True)


@pytest.mark.parametrize("fault", ["disk full", "read-only filesystem", "directory removed"])
def test_a_failed_write_is_logged_with_path_and_reason_and_the_next_durable_commit_succeeds(
        solo, tmp_path, request, caplog, fault):
    if fault == "directory removed":
        directory = tmp_path / "ckpt"
    else:
        mount = request.getfixturevalue("small_fs")
        directory = mount / "ckpt"
    state = make_state(directory, every=2)  # w alone is 256 KiB: the small disk cannot hold it
    if fault == "read-only filesystem":
        remount(mount, "ro,size=4m")
    elif fault == "directory removed":
        os.rmdir(directory)
    advance(state, 0)
    in_memory = serialization.dumps(state.live())
    with caplog.at_level(logging.WARNING, logger="elastic"):
        state.commit()  # no exception: the disk's trouble is the writer's
        assert state.finish_durable_commits(10)
    reason = {"disk full": os.strerror(errno.ENOSPC), "read-only filesystem": os.strerror(errno.EROFS),
              "directory removed": os.strerror(errno.ENOENT)}[fault]
    failure = [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(failure) == 1, caplog.text
    assert failure[0].startswith(f"durable commit 0 could not be written to {directory}{os.sep}elastic-commit-000000000000")
    assert reason in failure[0], failure[0]
    assert state._writer.failed is not None and state._writer.failed[0] == 0
    assert state.commit_step == 0
    advance(state, 7)
    state.restore()
    assert serialization.dumps(state.live()) == in_memory, "the in-memory commit is untouched"
    if fault == "directory removed":
        assert not directory.exists()
        checkpoint.prepare_directory(str(directory))
    else:
        assert not [p for p in directory.iterdir()], "nothing left behind on the failing disk"
        remount(mount, "rw,size=4m")
    caplog.clear()
    advance(state, 1)
    state.commit()
    advance(state, 2)
    expected = serialization.dumps(state.live())
    with caplog.at_level(logging.WARNING, logger="elastic"):
        state.commit()  # durable commit 2: retried, and written
        assert state.finish_durable_commits(10)
    assert payload_of(commit_file(directory, 2)) == expected
    assert state._writer.failed is None and state._writer.written == 2
    assert "after the write of commit 0 failed" in caplog.text


@pytest.mark.slow
def test_the_writer_thread_ends_when_idle_and_a_later_commit_starts_another(solo, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "IDLE_EXIT_S", 0.2)
    state = make_state(tmp_path / "ckpt", every=1)
    for i in range(2):
        advance(state, i)
        state.commit()
        wait_until(lambda: state._writer._thread is None, 10, "the idle writer thread to end")
        assert checkpoint.read_latest(str(tmp_path / "ckpt"))[0] == i


# --------------------------------------------------------------------------- the end
EXIT_SCRIPT = r"""
import logging, sys, time
import torch
import elastic
from elastic.runtime import collectives
from elastic.state import checkpoint

delay, finish_s, directory = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
real = checkpoint.write
def slow(d, step, snapshot, position=""):
    time.sleep(delay)
    return real(d, step, snapshot, position)
checkpoint.DurableWriter.write_file = staticmethod(slow)
checkpoint.FINISH_TIMEOUT_S = finish_s
collectives.set_communicator(elastic.Communicator.form(listener=None, job_id="solo", secret=b"s",
                                                       world_version=1, rank=0, peers=["127.0.0.1:1"]))
state = elastic.ObjectState(epoch=3, w=torch.arange(10.0))
state.enable_durable_commits(directory, 1)
state.commit()
print("committed", flush=True)
"""


def run_exit_script(tmp_path, delay, finish_s):
    directory = tmp_path / "ckpt"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(delay), str(finish_s), str(directory)],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert done.returncode == 0 and "committed" in done.stdout, done.stdout + done.stderr
    return directory, done.stderr, time.monotonic() - started


@pytest.mark.slow
def test_the_write_in_flight_is_finished_at_process_exit(tmp_path):
    # The script ends right after its commit, with the write 1 s from done.
    directory, _, _ = run_exit_script(tmp_path, delay=1.0, finish_s=20)
    step, state = checkpoint.read_file(commit_file(directory, 0))
    assert step == 0 and state["attrs"]["epoch"] == 3 and torch.equal(state["attrs"]["w"], torch.arange(10.0))


@pytest.mark.slow
def test_a_write_still_running_at_exit_is_given_up_at_the_deadline_and_logged(tmp_path):
    directory, stderr, took = run_exit_script(tmp_path, delay=50.0, finish_s=0.5)
    assert "durable commit 0 was still being written to" in stderr and "after 0.5 s" in stderr, stderr
    assert took < 30, f"the process took {took:.1f} s to exit: the deadline did not hold"
    assert not list(directory.glob("*.ckpt"))


# --------------------------------------------------------------------------- a real job
@pytest.mark.slow
def test_a_slow_disk_does_not_slow_the_step_loop_and_the_last_durable_commit_is_on_disk_when_run_returns(
        job_factory, tmp_path):
    # One worker, 30 steps of 0.1 s, a commit every 3 steps, every 2nd durable: a durable
    # commit every ~0.6 s on a disk that takes 0.4 s longer per write. Written inside commit()
    # each durable commit would stall the loop by those 0.4 s.
    ckpt = tmp_path / "ckpt"
    delay = 0.4
    job = job_factory(min_np=1, max_np=1, JOB_CHECKPOINT=ckpt, JOB_EPOCHS="1", JOB_STEP_SLEEP="0.1",
                      JOB_SLOW_DISK=str(delay))
    job.start("w0")
    assert job.wait(["w0"]) == {"w0": 0}, job.log("w0")
    events = job.events("w0")
    steps = [e for e in events if e["ev"] == "step"]
    commits = [e for e in events if e["ev"] == "commit"]
    written = {e["commit"]: e for e in events if e["ev"] == "durable"}
    durable = [c for c in commits if c["commit"] % 2 == 0]
    assert len(durable) >= 5 and set(written) == {c["commit"] for c in durable}, written

    def gap_around(commit):
        before = max(s["t"] for s in steps if s["t"] <= commit["t"])
        after = [s["t"] for s in steps if s["t"] > commit["t"]]
        return after[0] - before if after else None

    with_write = [g for g in (gap_around(c) for c in durable) if g is not None]
    without = [g for g in (gap_around(c) for c in commits if c["commit"] % 2) if g is not None]
    slowed = float(np.median(with_write)) - float(np.median(without))
    print(f"step gap across a durable commit: median {np.median(with_write):.3f} s, across another commit "
          f"{np.median(without):.3f} s (disk {delay} s slower per write)")
    assert slowed < delay / 2, f"durable commits slowed the step loop by {slowed:.2f} s each (the disk's {delay} s)"
    # The writes ran while the loop stepped on: steps were taken between a write's start and end.
    overlapped = [c for c, w in written.items() if any(w["started"] < s["t"] < w["t"] for s in steps)]
    assert overlapped, "no write overlapped a step"
    assert "waited" not in job.log("w0"), "no commit had to wait for the disk"
    # The job's last commit is durable; its write was still running when the loop ended, and
    # elastic.run returned only once it was on disk.
    last = commits[-1]["commit"]
    assert last % 2 == 0
    returned = next(e for e in events if e["ev"] == "returned")
    assert written[last]["t"] <= returned["t"], "elastic.run returned before its last durable commit was written"
    assert checkpoint.read_latest(str(ckpt))[0] == last
