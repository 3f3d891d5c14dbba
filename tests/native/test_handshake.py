"""Strangers, stale workers and impostors are refused with clear errors; the live ring never notices."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

import elastic

from elastic.ring.ring_view import RingView, list_digest

from .harness import TRANSPORTS, World

JOB, SECRET, VERSION = "live-job", b"live-secret", 5


def _shift_back_round(comm) -> bool:
    """One backward shift (on the reverse ring, which the first one forms): the next rank's bytes arrive."""
    got = comm.shift(np.full(1000, comm.rank, dtype=np.int32), backward=True).view(np.int32)
    return bool((got == (comm.rank + 1) % comm.size).all())


def _serve_then_allreduce(comm, conn):
    # The reverse ring forms before probes start, so its channel is fenced like the others.
    if not _shift_back_round(comm):
        raise AssertionError("the backward shift delivered the wrong bytes")
    conn.send(("ready", comm.listener.address))
    rounds = 0
    while True:
        if not conn.poll(60):
            raise TimeoutError("parent never said stop")
        cmd = conn.recv()
        buf = np.full(100_000, comm.rank + 1, dtype=np.float64)
        comm.allreduce_(buf, elastic.Sum)
        rounds += 1
        conn.send(("round", float(buf[0]) if _shift_back_round(comm) else -1.0))
        if cmd == "stop":
            return rounds, comm.listener.refusals()


_serve_then_allreduce.wants_conn = True


@pytest.fixture(scope="module", params=TRANSPORTS)
def live_ring(request):
    # Over shared memory too: a refused stranger never reaches the link set-up.
    yield from _serving_world(transport=request.param)


def _serving_world(**world_kw):
    """Three ranks that serve handshake probes while they keep allreducing; yields (world, addresses).
    `world.digest` is the digest of its list, which a connector must name to get past that check."""
    with World(3, _serve_then_allreduce, job_id=JOB, secret=SECRET, world_version=VERSION, **world_kw) as w:
        w.wait_formed()
        addresses = [w.expect(r, "ready")[1] for r in range(3)]
        w.digest = list_digest(addresses, w.hosts)
        yield w, addresses
        for r in range(3):
            w.send(r, "stop")
        for r in range(3):
            w.expect(r, "round")


def _ring_still_works(w):
    for r in range(3):
        w.send(r, "go")
    for r in range(3):
        assert w.expect(r, "round")[1] == 6.0


def _intrude(target, *, job=JOB, secret=SECRET, version=VERSION, size=3, rank=2, expect=elastic.HandshakeError,
             digest=bytes(32)):
    """Connects to the ring's rank 0 posing as its predecessor (rank 2 of a 3-rank world), with a
    view naming `digest`."""
    listener = elastic.Listener("127.0.0.1", 0)
    peers = [target, "127.0.0.1:1", listener.address] if size == 3 else [target, listener.address]
    view = RingView(rank, size, {r: (a, "") for r, a in enumerate(peers)}, None, digest)
    try:
        with pytest.raises(expect) as info:
            elastic.Communicator.form(listener=listener, job_id=job, secret=secret, world_version=version,
                                      rank=rank, view=view, config=elastic.CommConfig(form_timeout=5))
        return info.value
    finally:
        listener.close()


@pytest.mark.parametrize("case,kwargs,connector_says", [
    ("wrong job", {"job": "other-job"}, "job mismatch"),
    ("stale version", {"version": VERSION - 1}, "stale world version 4"),
    ("wrong world size", {"size": 2, "rank": 1}, "world size mismatch"),
    ("duplicate", {}, "duplicate connection"),
    ("view of another world", {"digest": b"\x01" * 32}, "world digest mismatch at world version 5"),
])
def test_refused_handshake_leaves_the_live_ring_working(live_ring, case, kwargs, connector_says):
    # Every case but the last names the live world's digest: a connector told other members of
    # the same version (a view of another world) is refused though job, version, size and
    # rank all agree.
    w, addresses = live_ring
    err = _intrude(addresses[0], **{"digest": w.digest, **kwargs})
    assert connector_says in str(err) and "refused" in str(err), err
    # The refusal is authenticated (the ring's rank 0 proved the secret): a verdict on this
    # connection, nobody to blame.
    assert err.kind == elastic.ErrorKind.Refused and err.peer_rank is None
    _ring_still_works(w)


def test_a_refusal_to_a_connector_without_the_secret_blames_the_peer_it_cannot_trust(live_ring):
    # Holding another secret, the intruder cannot check the refusal's MAC: to it, whatever
    # answers at rank 0's address does not prove the job's secret, and that is rank 0's failure
    # as far as it can tell (it reports it), never a verdict it acts on.
    w, addresses = live_ring
    err = _intrude(addresses[0], secret=b"guess", expect=elastic.BadPeerError)
    assert "authentication failed" in str(err) and "without proving this job's secret" in str(err), err
    assert (err.kind, err.peer_rank, err.reason) == (elastic.ErrorKind.BadPeer, 0, "bad_peer")
    _ring_still_works(w)


def test_garbage_and_silent_connections_do_not_disturb_the_ring(live_ring):
    w, addresses = live_ring
    host, port = addresses[1].rsplit(":", 1)
    scanner = socket.create_connection((host, int(port)), timeout=5)
    scanner.close()  # a port scanner: connect and leave
    silent = socket.create_connection((host, int(port)), timeout=5)  # connects, says nothing
    garbage = socket.create_connection((host, int(port)), timeout=5)
    garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    garbage.settimeout(5)
    try:
        answer = garbage.recv(100)
    except ConnectionResetError:  # closed with our bytes unread: RST instead of FIN
        answer = b""
    assert answer == b""  # closed without an answer
    garbage.close()
    _ring_still_works(w)
    silent.close()


def test_refusals_are_reported_on_the_acceptor_side():
    listener = elastic.Listener("127.0.0.1", 0)
    other = elastic.Listener("127.0.0.1", 0)
    # `other` forms world version 7 of job "a" (its predecessor never comes); we come as version 6.
    from elastic.ring import _native
    config = elastic.CommConfig(timeout=5, form_timeout=5)
    waiting = elastic.Communicator(_native.Communicator(other, "a", b"s", 7, 1, [listener.address, other.address],
                                                        config.to_native()), config)
    outcome = []

    def form():
        try:
            waiting.connect()
            outcome.append("formed")
        except elastic.WorkerLostError as e:
            outcome.append(e.reason)

    th = threading.Thread(target=form)
    th.start()
    with pytest.raises(elastic.HandshakeError, match="stale world version 6"):
        elastic.Communicator.form(listener=listener, job_id="a", secret=b"s", world_version=6, rank=0,
                                  peers=[listener.address, other.address], config=elastic.CommConfig(form_timeout=5))
    assert any("stale world version 6" in r for r in other.refusals())
    waiting.abort("done")
    th.join(10)
    assert outcome == ["aborted"]
    waiting.close()
    listener.close()
    other.close()


def test_hmac_matches_the_standard_library():
    import hashlib
    import hmac
    from elastic.ring import _native
    for key, data in [(b"", b""), (b"k", b"data"), (b"x" * 100, b"y" * 1000), (bytes(range(64)), b"abc")]:
        assert _native.hmac_sha256(key, data) == hmac.new(key, data, hashlib.sha256).digest()


# ---------------------------------------------------------------- protocol 2: ring channels
#
# One listener serves every ring a communicator forms for its world version: the flat ring
# (channel 0), for the hierarchical allreduce the host-local ring (1) and the leaders' ring
# (2), and the reverse ring of backward shifts (3). The channel is part of the authenticated
# HELLO; each channel has its own expected predecessor, and the same fencing and refusals
# hold on every channel.

import struct  # noqa: E402

from . import wire  # noqa: E402
from .harness import mixed_hosts  # noqa: E402


def _raw_handshake(address, *, channel, from_rank, to_rank, size=3, job=JOB, secret=SECRET, version=VERSION,
                   digest=bytes(32)):
    """Speaks protocol 4 by hand; returns ("ok", None) or ("refused", reason), checking a refusal's MAC."""
    host, port = address.rsplit(":", 1)
    body = wire.hello_body(job, version, from_rank, to_rank, size, channel, digest)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(wire.msg(wire.HELLO, body))
        mtype, status, nonce = wire.read_msg(s)
        assert (mtype, status) == (wire.ACK, wire.OK)  # refusals come only after the proof
        s.sendall(wire.msg(wire.PROOF, wire.mac(secret, b"connector", body, nonce)))
        mtype, status, answer = wire.read_msg(s)
        assert mtype == wire.RESULT
        if status == wire.OK:
            return "ok", None
        code, reason, authenticated = wire.read_refusal(answer, secret, body, nonce)
        # Signed exactly when the connector proved the secret (code 0: it did not).
        assert authenticated == (code != 0), (code, reason)
        return "refused", reason


@pytest.fixture(scope="module")
def hierarchical_ring():
    # Hosts a, a, b: rank 0 expects rank 2 on the flat ring, rank 1 on the local ring and rank 2
    # on the leaders' ring; rank 1 expects rank 0 on the flat and the local ring and no leaders' ring.
    yield from _serving_world(transport=mixed_hosts(2, 1),
                              config=elastic.CommConfig(timeout=60, algorithm="hierarchical"))


@pytest.mark.parametrize("target,kwargs,reason", [
    (1, {"channel": 2, "from_rank": 0, "to_rank": 1}, "forms no leaders' ring"),
    (0, {"channel": 1, "from_rank": 2, "to_rank": 0}, "not this worker's host-local ring predecessor (expected rank 1)"),
    (0, {"channel": 2, "from_rank": 2, "to_rank": 0}, "leaders' ring of world version 5 is already connected"),
    (0, {"channel": 1, "from_rank": 1, "to_rank": 0}, "host-local ring of world version 5 is already connected"),
    (0, {"channel": 3, "from_rank": 2, "to_rank": 0}, "not this worker's reverse ring predecessor (expected rank 1)"),
    (2, {"channel": 3, "from_rank": 0, "to_rank": 2}, "reverse ring of world version 5 is already connected"),
    (0, {"channel": 9, "from_rank": 2, "to_rank": 0}, "unknown ring channel 9"),
    (0, {"channel": 2, "from_rank": 2, "to_rank": 0, "version": VERSION - 1}, "stale world version 4"),
    (0, {"channel": 1, "from_rank": 1, "to_rank": 0, "size": 4}, "world size mismatch"),
    (0, {"channel": 1, "from_rank": 1, "to_rank": 0, "digest": bytes(32)}, "world digest mismatch"),
    (1, {"channel": 0, "from_rank": 0, "to_rank": 1, "digest": b"\xff" * 32}, "world digest mismatch"),
])
def test_every_ring_channel_is_fenced_and_refusals_name_it(hierarchical_ring, target, kwargs, reason):
    w, addresses = hierarchical_ring
    outcome, text = _raw_handshake(addresses[target], **{"digest": w.digest, **kwargs})
    assert outcome == "refused" and reason in text, text
    _ring_still_works(w)


def test_a_channel_handshake_without_the_secret_learns_nothing(hierarchical_ring):
    w, addresses = hierarchical_ring
    outcome, text = _raw_handshake(addresses[0], channel=2, from_rank=2, to_rank=0, secret=b"guess")
    assert outcome == "refused" and "authentication failed" in text and "leaders" not in text
    _ring_still_works(w)


def test_a_protocol_1_hello_is_closed_unanswered_and_logged():
    listener = elastic.Listener("127.0.0.1", 0)
    try:
        host, port = listener.address.rsplit(":", 1)
        old = struct.pack(">QIII", VERSION, 1, 2, 3) + bytes(16) + struct.pack(">H", len(JOB)) + JOB.encode()
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(wire.msg(wire.HELLO, old, proto=1))
            try:
                assert s.recv(100) == b""  # closed without an answer
            except ConnectionResetError:
                pass
        deadline = time.monotonic() + 5
        while not listener.refusals() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert any("unsupported ring protocol version 1 (this build speaks 4)" in r for r in listener.refusals())
    finally:
        listener.close()


def test_the_hierarchical_ring_survives_intruders_with_numpy_bits(hierarchical_ring):
    _ring_still_works(hierarchical_ring[0])
