"""A world's device communicator as ``WorldDevice`` runs it, on fake backends: a collective that
never completes is timed out and aborted within the bound, an abort that never returns ends the
process with its own status, nothing runs on an aborted communicator."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from elastic.ring.errors import ErrorKind, WorkerLostError
from elastic.runtime.worker_config import DEVICE_ABORT_STUCK_EXIT
from elastic.torchdist.device_backend import DeviceBackend
from elastic.torchdist.device_world import WorldDevice, abort_within
from tests.waiting import wait_until


class NeverDone:
    """torch's Work of a collective a peer never joins: its wait returns only once released."""

    def __init__(self) -> None:
        self.released = threading.Event()


class HangingBackend(DeviceBackend):
    """A backend whose collectives never complete (a live peer stopped participating); its abort
    releases them, as NCCL's abort ends the kernels, unless ``abort_hangs``."""

    name = "fake"
    device_type = "cpu"

    def __init__(self, *, abort_hangs: bool = False, complete: bool = False) -> None:
        super().__init__(world_version=7, rank=1, size=3)
        self.abort_hangs = abort_hangs
        self.complete = complete
        self.started = []
        self.aborted = threading.Event()
        self.abort_calls = 0

    def run(self, method, *args):
        work = NeverDone()
        if self.complete:
            work.released.set()
        self.started.append((method, work))
        return work

    def finish(self, work):
        work.released.wait()
        if self.aborted.is_set() and not self.complete:
            raise RuntimeError("communicator aborted")

    def abort(self):
        self.abort_calls += 1
        if self.abort_hangs:
            threading.Event().wait(3600)
        self.aborted.set()
        for _, work in self.started:
            work.released.set()


class Recorder:
    def __init__(self) -> None:
        self.failures = []
        self.failed = threading.Event()
        self.exits = []
        self.exited = threading.Event()

    def failed_callback(self, device, error, blame):
        self.failures.append((device, error, blame))
        self.failed.set()

    def exit_now(self, code):
        self.exits.append(code)
        self.exited.set()


def make(backend, rec, collective_timeout=0.3, abort_timeout=0.5):
    return WorldDevice(backend, collective_timeout=collective_timeout, abort_timeout=abort_timeout,
                       failed=rec.failed_callback, exit_now=rec.exit_now)


def test_a_collective_that_never_completes_is_timed_out_blamed_on_the_next_rank_and_aborted():
    backend, rec = HangingBackend(), Recorder()
    device = make(backend, rec)
    started = time.monotonic()
    entry = device.run("all_reduce", "allreduce", [])
    assert rec.failed.wait(5), "the collective timeout never fired"
    took = time.monotonic() - started
    assert 0.3 <= took < 2.5, took
    _, error, blame = rec.failures[0]
    assert isinstance(error, WorkerLostError) and error.kind == ErrorKind.Timeout
    assert error.peer == 2 and error.world_version == 7 and blame
    wait_until(backend.aborted.is_set, 5, "the backend's abort")
    assert device.aborted and backend.abort_calls == 1
    with pytest.raises(WorkerLostError):
        device.wait(entry)
    assert rec.exits == [], "an abort that returned must not end the process"


def test_a_waiter_is_failed_by_the_abort_not_left_waiting():
    backend, rec = HangingBackend(), Recorder()
    device = make(backend, rec, collective_timeout=60)
    entry = device.run("all_reduce", "allreduce", [])
    got = []
    device.when_done(entry, got.append)
    waiter = threading.Thread(target=lambda: got.append(pytest.raises(WorkerLostError, device.wait, entry)))
    waiter.start()
    device.abort("world version 8 formed")
    waiter.join(5)
    assert not waiter.is_alive(), "wait() still blocked after the abort"
    assert isinstance(got[0], WorkerLostError) and got[0].kind == ErrorKind.Aborted
    assert rec.failures == [], "an abort from outside is no failure of the device"


def test_nothing_is_started_on_an_aborted_communicator_and_abort_is_idempotent():
    backend, rec = HangingBackend(), Recorder()
    device = make(backend, rec)
    first = device.abort("ring aborted: peer lost")
    assert device.abort("again") is first
    first.join(5)
    with pytest.raises(WorkerLostError, match="world version 7"):
        device.run("broadcast", "broadcast", [])
    assert backend.started == [] and backend.abort_calls == 1


def test_a_finished_collective_is_handed_on_in_order():
    backend, rec = HangingBackend(complete=True), Recorder()
    device = make(backend, rec, collective_timeout=60)
    order = []
    entries = [device.run(f"c{i}", "allreduce", [], done=lambda e, i=i: order.append((i, e))) for i in range(5)]
    for entry in entries:
        device.wait(entry)
    assert order == [(i, None) for i in range(5)]
    device.close("the ring was closed")
    assert rec.exits == [] and rec.failures == []


def test_closing_a_world_leaves_no_thread_of_it_running_or_holding_a_collective():
    # A daemon thread that drops torch's Work while the interpreter finalizes is ended inside
    # its destructor (which releases the GIL) and the process aborts: close() must return only
    # once the watcher and the deadline thread have let go of every collective.
    backend, rec = HangingBackend(complete=True), Recorder()
    device = make(backend, rec, collective_timeout=60)
    entries = [device.run(f"c{i}", "allreduce", []) for i in range(3)]
    for entry in entries:
        device.wait(entry)
    works = [weakref.ref(work) for _, work in backend.started]
    del entries, entry
    backend.started.clear()
    assert device.close("the ring was closed") == []
    gc.collect()
    assert [w for w in works if w() is not None] == []
    assert not [t for t in threading.enumerate() if t.name in ("elastic-device-watch", "elastic-device-deadline")
                and t in device._threads]


def test_closing_a_world_whose_collective_cannot_be_cut_short_returns_the_watcher_still_in_it():
    backend, rec = HangingBackend(), Recorder()
    backend.abort = lambda: None   # gloo: its abort() ends nothing in flight
    waiting, finish = threading.Event(), backend.finish
    backend.finish = lambda work: (waiting.set(), finish(work))
    device = make(backend, rec, collective_timeout=60, abort_timeout=0.2)
    device.run("all_reduce", "allreduce", [])
    assert waiting.wait(5), "the watcher never waited on the collective"
    running = device.close("the ring was closed")
    assert [t.name for t in running] == ["elastic-device-watch"]
    backend.started[0][1].released.set()   # the collective ends (gloo's own timeout)
    running[0].join(5)
    assert not running[0].is_alive()


def test_an_abort_that_never_returns_ends_the_process_with_its_own_status_within_the_bound(capfd):
    backend, rec = HangingBackend(abort_hangs=True), Recorder()
    device = make(backend, rec, abort_timeout=0.5)
    device.run("all_reduce", "allreduce", [])
    started = time.monotonic()
    device.abort("world version 8 formed")
    assert rec.exited.wait(5), "the stuck abort never ended the process"
    took = time.monotonic() - started
    assert 0.5 <= took < 2.0, took
    assert rec.exits == [DEVICE_ABORT_STUCK_EXIT]
    err = capfd.readouterr().err
    assert "did not return within 0.5 s (ELASTIC_DEVICE_ABORT_TIMEOUT)" in err
    assert f"exits with status {DEVICE_ABORT_STUCK_EXIT}" in err


def test_an_abort_that_raises_has_returned():
    exits = []

    def fails():
        raise RuntimeError("ncclCommAbort failed")

    t = abort_within(fails, 0.3, "a test communicator", exits.append)
    t.join(5)
    wait_until(lambda: not [th for th in threading.enumerate() if th.name == "elastic-device-abort-guard"], 5,
               "the guard to see the abort return")
    assert exits == []
