"""Races, strays and misuse: the core stays memory-safe, fails with the right error, and forms anyway."""

from __future__ import annotations

import gc
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest
import torch

import elastic

from .harness import TRANSPORTS, World


def _abort_races_close(comm):
    # The rendezvous pump aborts while the training thread closes: must never crash.
    listener, rank, size = comm.listener, comm.rank, comm.size
    peers = [a.decode().strip() for a in _exchange(comm, listener.address)]
    comm.close()
    for cycle in range(30):
        c = elastic.Communicator.form(listener=listener, job_id="test-job", secret=b"test-secret",
                                      world_version=2 + cycle, rank=rank, peers=peers, hosts=comm.hosts,
                                      config=elastic.CommConfig(timeout=10, form_timeout=10))
        stop = threading.Event()

        def hammer():
            while not stop.is_set():
                c.abort("race")

        threads = [threading.Thread(target=hammer) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            c.allreduce_(np.ones(1 << 16, dtype=np.float32), elastic.Sum)
        except elastic.WorkerLostError:
            pass
        c.close()
        stop.set()
        for t in threads:
            t.join(10)
    return "survived"


def _exchange(comm, text):
    raw = np.frombuffer(text.encode().ljust(64), dtype=np.uint8).copy()
    out = comm.allgather(raw)
    return [bytes(out[i * 64:(i + 1) * 64]) for i in range(comm.size)]


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abort_from_other_threads_racing_close_never_crashes(transport):
    with World(2, _abort_races_close, transport=transport) as w:
        assert w.results(timeout=120) == ["survived", "survived"]


def _dropped_handles(comm):
    for _ in range(20):
        comm.allreduce_async_(np.ones(10_000, dtype=np.float32), elastic.Sum)  # handle dropped at once
    gc.collect()
    victims = [np.zeros(10_000, dtype=np.float32) for _ in range(20)]  # may reuse the freed memory
    comm.barrier()  # flushes and runs the dropped allreduces
    return all(float(v.sum()) == 0.0 for v in victims)


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dropping_an_async_handle_does_not_corrupt_other_memory(transport):
    assert run(2, _dropped_handles, transport=transport) == [True, True]


def run(n, fn, **kw):
    with World(n, fn, **kw) as w:
        return w.results()


def _form_pair(listeners, version=1, secret=b"s", timeout=10.0):
    peers = [l.address for l in listeners]
    out, errors = [None, None], []

    def one(rank):
        try:
            out[rank] = elastic.Communicator.form(listener=listeners[rank], job_id="j", secret=secret,
                                                  world_version=version, rank=rank, peers=peers,
                                                  config=elastic.CommConfig(form_timeout=timeout))
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return out, errors


def test_a_ring_forms_while_strays_flood_the_listener():
    listeners = [elastic.Listener("127.0.0.1", 0) for _ in range(2)]
    host, port = listeners[1].address.rsplit(":", 1)
    strays = []
    try:
        for _ in range(200):  # more than the listener keeps pending: silent connections
            strays.append(socket.create_connection((host, int(port)), timeout=5))
        for _ in range(10):  # HELLOs claiming a far-future world version, without the secret
            s = socket.create_connection((host, int(port)), timeout=5)
            job = b"j"
            body = struct.pack(">QIII", 10**12, 0, 1, 2) + b"\0" * 16 + struct.pack(">H", len(job)) + job
            s.sendall(struct.pack(">IHBBI", 0x45524E47, 1, 1, 0, len(body)) + body)
            strays.append(s)
        started = time.monotonic()
        comms, errors = _form_pair(listeners, timeout=10)
        assert errors == [], errors
        assert time.monotonic() - started < 5
        t = [np.ones(4, dtype=np.float32) for _ in range(2)]
        threads = [threading.Thread(target=comms[r].allreduce_, args=(t[r], elastic.Sum)) for r in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(10)
        assert all(float(x[0]) == 2.0 for x in t)
        for c in comms:
            c.close()
    finally:
        for s in strays:
            s.close()
        for l in listeners:
            l.close()


def test_unauthenticated_peer_learns_nothing_about_the_ring():
    listeners = [elastic.Listener("127.0.0.1", 0) for _ in range(2)]
    outsider = elastic.Listener("127.0.0.1", 0)
    comms, errors = _form_pair(listeners)
    assert errors == []
    try:
        with pytest.raises(elastic.BadPeerError) as info:  # to the outsider, rank 1 proves nothing
            elastic.Communicator.form(listener=outsider, job_id="guess", secret=b"wrong", world_version=1, rank=0,
                                      peers=[outsider.address, listeners[1].address],
                                      config=elastic.CommConfig(form_timeout=5))
        text = str(info.value)
        assert "authentication failed" in text
        assert "'j'" not in text and "world version 1" not in text.split("refused")[-1]
        # The acceptor logs the details locally.
        assert any("claiming job 'guess'" in r for r in listeners[1].refusals())
    finally:
        for c in comms:
            c.close()
        for l in listeners + [outsider]:
            l.close()


def _fp16_average_large(comm):
    t = torch.full((200_000,), 40000.0, dtype=torch.float16)  # partial sums overflow float16
    comm.allreduce_(t, elastic.Average)
    b = torch.full((200_000,), 1.0e38, dtype=torch.bfloat16)  # bfloat16 has float32's range
    comm.allreduce_(b, elastic.Average)
    return float(t[0]), float(t[-1]), bool(torch.isfinite(b).all())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sixteen_bit_average_accumulates_in_float32_without_overflow(transport):
    for first, last, finite in run(2, _fp16_average_large, transport=transport):
        assert first == last == 40000.0 and finite


def _mismatched(comm):
    n = 1000 if comm.rank == 0 else 2000
    try:
        comm.allreduce_(np.ones(n, dtype=np.float32), elastic.Sum)
    except elastic.CollectiveMismatchError as e:
        return "mismatch", e.op
    except elastic.WorkerLostError as e:
        return e.reason, e.op
    return "ok", ""


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ranks_calling_different_collectives_get_a_mismatch_error(transport):
    results = run(2, _mismatched, config=elastic.CommConfig(small_bytes=0), transport=transport)
    assert ("mismatch", "allreduce") in results
    assert all(kind in ("mismatch", "propagated", "peer_lost") for kind, _ in results)


def _async_failure(comm, conn):
    if comm.rank == 1:
        return "left"  # closes its end: rank 0's async allreduce cannot complete
    h = comm.allreduce_async_(np.ones(1 << 20, dtype=np.float32), elastic.Sum)
    try:
        comm.synchronize(h)
        first = "no error"
    except elastic.WorkerLostError as e:
        first = e.reason
    h2 = comm.allreduce_async_(np.ones(10, dtype=np.float32), elastic.Sum)
    comm.close()
    try:
        comm.synchronize(h2)
        after_close = "no error"
    except elastic.WorkerLostError as e:
        after_close = e.reason
    return first, after_close


_async_failure.wants_conn = True


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_failed_async_work_raises_worker_lost_in_synchronize_even_after_close(transport):
    with World(2, _async_failure, transport=transport) as w:
        res = w.results()
    first, after_close = res[0]
    assert first in ("peer_lost", "propagated")
    assert after_close in ("peer_lost", "propagated", "aborted")


def _loop_op(comm, conn):
    op = OPS[comm.size]
    buf = np.ones(16 << 20, dtype=np.float32)
    op(comm, buf)
    conn.send(("running", time.monotonic()))
    while True:
        op(comm, buf)


_loop_op.wants_conn = True
OPS = {}


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name,fn", [
    ("broadcast", lambda c, b: c.broadcast_(b, root_rank=0)),
    ("allgather", lambda c, b: c.allgather(b[: 1 << 20])),
    ("barrier", lambda c, b: c.barrier()),
])
def test_every_collective_fails_fast_when_a_peer_is_killed(name, fn, transport):
    OPS[3] = fn
    with World(3, _loop_op, transport=transport) as w:
        w.wait_formed()
        for r in range(3):
            w.expect(r, "running", timeout=60)
        killed = w.kill(2, signal.SIGKILL)
        for r in (0, 1):
            msg = w.expect(r, "error", timeout=10)
            assert msg[1] == "WorkerLostError", msg[2]
            # Fast means from the dead peer's connection, not a deadline (the collective timeout
            # is 30 minutes here); on a loaded 2-core machine a survivor spinning in a loop of
            # small collectives was once scheduled 0.67 s after the kill, so the bound is 1 s.
            assert msg[5] - killed < 1.0, f"rank {r} took {msg[5] - killed:.3f} s: {msg[2]}"
            assert msg[4]["op"] == name


def _allgather_sizes_that_wrap(comm):
    # Sizes a caller derived from peers' counts, adding up past 2**64: the wrapped sum (0) would
    # pass for the empty output's, and this rank's 8 bytes would be copied past its end.
    if comm.rank == 1:
        return None
    mine = np.ones(8, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"per-rank sizes add up to 2\*\*64 bytes or more"):
        comm._native.allgather_(mine, np.empty(0, dtype=np.uint8), [8, 2 ** 64 - 8])
    return "refused"


def test_allgather_sizes_that_add_up_past_2_64_are_refused_before_any_copy():
    with World(2, _allgather_sizes_that_wrap) as w:
        assert w.results(timeout=30) == ["refused", None]


def _mismatched_calls(comm):
    """Ranks 0 and 2 allreduce 2000 floats, rank 1 1000 (after a barrier); each returns
    what its error says it called."""
    comm.barrier()
    n = 1000 if comm.rank == 1 else 2000
    try:
        comm.allreduce_(np.ones(n, dtype=np.float32), elastic.Sum)
    except elastic.ElasticError as e:
        return type(e).__name__, None if e.call is None else (e.call.seq, e.call.tag, e.call.describe)
    return "ok", None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_rank_of_a_mismatch_says_which_collective_it_called(transport):
    # What the world compares after a mismatch (elastic.runtime.divergence): the same sequence
    # number everywhere, the same tag where the same collective was called, another where not.
    results = run(3, _mismatched_calls, config=elastic.CommConfig(small_bytes=0), transport=transport)
    assert "CollectiveMismatchError" in [kind for kind, _ in results], results
    calls = [call for _, call in results]
    assert None not in calls and len({call[0] for call in calls}) == 1, results
    assert calls[0][1] == calls[2][1] != calls[1][1], results
    assert "2000 elements" in calls[0][2] and "1000 elements" in calls[1][2], results
