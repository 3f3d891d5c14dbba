"""A bad peer is that peer's failure: typed errors naming it, never a verdict taken from its words.

A neighbour whose announced address is unusable, or whatever answers there without the job's
secret, makes ``connect()`` raise ``BadPeerError`` (a ``WorkerLostError``) naming that rank, so
the runtime reports it and the healthy workers go on; never ``ValueError``, and never a
settings verdict read from unauthenticated text. A connection dropped halfway through the
handshake is retried until the form deadline, and a full listener drops the newest stray,
not the neighbour halfway through its handshake.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

import elastic
from elastic import ErrorKind
from elastic.ring import _native
from elastic.ring.errors import RingFailure, from_native
from tests.waiting import wait_until

from . import wire
from .wire import ACK, HELLO, OK, PROOF, REFUSED, RESULT, mac, msg, read_msg

JOB, SECRET, VERSION = "bad-peer-job", b"bad-peer-secret", 3
FORMS_NO = (b"this worker forms no leaders' ring at world version 3 (channel 2): is ELASTIC_ALLREDUCE_ALGORITHM "
            b"the same on every worker?")


def _hello(job=JOB) -> bytes:
    return wire.hello_body(job, VERSION, 0, 1, 2)


def _form(peers, *, form_timeout=5.0, timeout=30.0):
    """Forms rank 0 of `peers` (None: its own listener) and closes it again."""
    own = elastic.Listener("127.0.0.1", 0)
    peers = [own.address if p is None else p for p in peers]
    try:
        elastic.Communicator.form(listener=own, job_id=JOB, secret=SECRET, world_version=VERSION, rank=0,
                                  peers=peers, config=elastic.CommConfig(form_timeout=form_timeout,
                                                                         timeout=timeout)).close()
    finally:
        own.close()


# ---------------------------------------------------------------- unusable addresses


@pytest.mark.slow
@pytest.mark.parametrize("address,kind,says", [
    ("0.0.0.0:1", ErrorKind.Unreachable, "wildcard address 0.0.0.0:1"),
    ("[::]:4000", ErrorKind.Unreachable, "wildcard address"),
    ("no-port-here", ErrorKind.Unreachable, "expected HOST:PORT"),
    ("127.0.0.1:99999", ErrorKind.Unreachable, "invalid port"),
    ("no-such-host.invalid:4000", ErrorKind.Unreachable, "no-such-host.invalid"),
    ("closed", ErrorKind.Unreachable, "nothing listens at its announced address"),
])
def test_a_neighbour_with_an_unusable_address_is_a_bad_peer_named_by_rank(address, kind, says):
    if address == "closed":
        address = wire.closed_port_address()
    started = time.monotonic()
    with pytest.raises(elastic.BadPeerError) as info:  # not ValueError: the address is rank 1's doing
        _form([None, address], form_timeout=1.5)
    err = info.value
    assert isinstance(err, elastic.WorkerLostError)  # elastic.run's recovery path
    assert (err.kind, err.peer_rank, err.peer, err.rank, err.world_version) == (kind, 1, 1, 0, VERSION), err
    assert says in str(err) and "rank 1" in str(err), err
    assert time.monotonic() - started < 10


@pytest.mark.slow
def test_a_neighbour_that_accepts_no_connection_is_given_up_after_the_collective_timeout():
    # The form deadline may be long (the runtime's is the world timeout, 600 s): a neighbour
    # that nothing answers for is given up after the no-progress timeout of a collective.
    started = time.monotonic()
    with pytest.raises(elastic.BadPeerError) as info:
        _form([None, wire.closed_port_address()], form_timeout=60, timeout=1.0)
    assert info.value.kind == ErrorKind.Unreachable and info.value.peer_rank == 1
    assert "accepted no connection for 1 s" in str(info.value)
    assert time.monotonic() - started < 10


def test_a_world_built_on_the_native_api_with_a_wildcard_peer_fails_typed_at_form():
    listener = elastic.Listener("127.0.0.1", 0)
    try:
        comm = _native.Communicator(listener, JOB, SECRET, VERSION, 1, ["0.0.0.0:1", listener.address],
                                    elastic.CommConfig(timeout=5, form_timeout=5).to_native())  # created: not ours
        with pytest.raises(_native.RingFailure) as info:   # the core's own failure; the ring layer types it
            comm.form()
        kind, _, op, _, _, peer = info.value.args[:6]   # then the collective it failed in, if any
        assert (kind, op, peer) == (ErrorKind.Unreachable, "form", 0)
        typed = from_native(info.value)
        assert isinstance(typed, elastic.BadPeerError) and typed.peer_rank == 0
        comm.close()
    finally:
        listener.close()


def test_peer_supplied_text_in_an_address_is_escaped_in_the_error():
    with pytest.raises(elastic.BadPeerError) as info:
        _form([None, "\x1b[2J\x1b[31mevil\nline:1"], form_timeout=1)
    text = str(info.value)
    assert "\x1b" not in text and "\n" not in text and "\\x1b[2J" in text, text


# ---------------------------------------------------------------- what answers there


def _refuse_before_proof(conn):
    with conn:
        read_msg(conn)
        conn.sendall(msg(ACK, FORMS_NO, REFUSED))


def _plain_text_refusal(conn):
    with conn:
        read_msg(conn)
        conn.sendall(msg(ACK, bytes(16)))
        read_msg(conn)
        conn.sendall(msg(RESULT, FORMS_NO, REFUSED))  # protocol 2's unsigned refusal


def _garbage(conn):
    with conn:
        read_msg(conn)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")


def _proves_another_secret(conn):
    with conn:
        _, _, body = read_msg(conn)
        conn.sendall(msg(ACK, bytes(16)))
        read_msg(conn)
        conn.sendall(msg(RESULT, mac(b"another secret", b"acceptor", body, bytes(16))))


@pytest.mark.parametrize("answer,says", [
    (wire.refuse_after_proof(FORMS_NO, None), "without proving this job's secret (not acted on)"),
    (wire.refuse_after_proof(FORMS_NO, b"another secret"), "without proving this job's secret (not acted on)"),
    (_refuse_before_proof, "before any proof (unauthenticated, not acted on)"),
    (_plain_text_refusal, "malformed refusal"),
    (_garbage, "not an elastic-ring handshake"),
    (_proves_another_secret, "failed to prove this job's secret"),
], ids=["unsigned", "signed-with-another-secret", "before-proof", "plain-text", "garbage", "wrong-acceptor-mac"])
def test_an_unauthenticated_answer_is_a_bad_peer_never_a_settings_verdict(answer, says):
    fake = wire.FakeListener(answer)
    try:
        with pytest.raises(elastic.BadPeerError) as info:  # not SettingsMismatchError, not HandshakeError
            _form([None, fake.address])
        err = info.value
        assert (err.kind, err.peer_rank) == (ErrorKind.BadPeer, 1), err
        assert says in str(err), err
    finally:
        fake.close()
    assert fake.errors == []


def test_a_settings_verdict_is_trusted_when_its_mac_proves_the_secret():
    fake = wire.FakeListener(wire.refuse_after_proof(FORMS_NO, SECRET))
    try:
        with pytest.raises(elastic.SettingsMismatchError) as info:
            _form([None, fake.address])
        assert info.value.kind == ErrorKind.SettingsMismatch and info.value.peer_rank is None
        assert "is ELASTIC_ALLREDUCE_ALGORITHM the same on every worker?" in str(info.value)
        assert not isinstance(info.value, (elastic.WorkerLostError, elastic.HandshakeError))
    finally:
        fake.close()


def _failure(kind, op="form"):
    return RingFailure(kind, "m", op, 4, 0, 1)


def test_every_native_error_kind_maps_to_a_typed_exception():
    for kind in ErrorKind:
        err = from_native(_failure(kind))
        assert type(err) is not elastic.ElasticError, f"{kind} has no exception class"
        if kind == ErrorKind.Invalid:
            assert isinstance(err, ValueError)
            continue
        assert err.kind == kind
        assert err.peer_rank == (1 if kind in (ErrorKind.PeerLost, ErrorKind.Timeout, ErrorKind.Unreachable,
                                               ErrorKind.BadPeer) else None), kind
    assert from_native(_failure(ErrorKind.Propagated, "allreduce")).reason == "propagated"
    assert from_native(_failure(ErrorKind.Unreachable)).reason == "unreachable"


# ---------------------------------------------------------------- dropped connections are retried


class _FlakyProxy:
    """Stands at rank 1's announced address: spoils the first connections (`plan`), then relays."""

    def __init__(self, target: str, plan):
        host, port = target.rsplit(":", 1)
        self.target, self.plan = (host, int(port)), list(plan)
        self.fake = wire.FakeListener(self._serve)
        self.address = self.fake.address

    def _serve(self, conn):
        how = self.plan.pop(0) if self.plan else "relay"
        if how == "eof":  # closed before a word
            conn.close()
            return
        hello = read_msg(conn)
        if how == "reset-after-hello":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            return
        upstream = socket.create_connection(self.target, timeout=5)
        upstream.sendall(msg(hello[0], hello[2]))
        if how == "eof-after-proof":  # the listener's ACK goes back, the PROOF goes nowhere
            ack = read_msg(upstream)
            conn.sendall(msg(ack[0], ack[2], ack[1]))
            read_msg(conn)
            conn.close()
            upstream.close()
            return
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst):
        src.settimeout(None)
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def test_a_connect_dropped_before_its_handshake_completes_is_retried_until_it_forms():
    listeners = [elastic.Listener("127.0.0.1", 0) for _ in range(2)]
    proxy = _FlakyProxy(listeners[1].address, ["eof", "reset-after-hello", "eof-after-proof"])
    peers = [listeners[0].address, proxy.address]  # rank 0 reaches rank 1 only through the proxy
    results, errors = [None, None], []

    def rank(r):
        try:
            with elastic.Communicator.form(listener=listeners[r], job_id=JOB, secret=SECRET, world_version=VERSION,
                                           rank=r, peers=peers, config=elastic.CommConfig(form_timeout=20)) as c:
                buf = np.full(1000, r + 1.0, dtype=np.float32)
                c.allreduce_(buf, elastic.Sum)
                results[r] = float(buf[0])
        except Exception as e:  # asserted below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == [] and results == [3.0, 3.0], errors
        assert proxy.fake.connections == 4 and proxy.fake.errors == []  # three spoiled attempts, then one that formed
    finally:
        proxy.fake.close()
        for lst in listeners:
            lst.close()


# ---------------------------------------------------------------- a full listener


class _Former(threading.Thread):
    """Forms a communicator in the background (it never completes: its neighbour is a test)."""

    def __init__(self, comm):
        super().__init__(daemon=True)
        self.comm, self.error = comm, None

    def run(self):
        try:
            self.comm.connect()
        except Exception as e:  # the abort in stop(); checked there
            self.error = e

    def stop(self):
        self.comm.abort("test over")
        if self.ident is not None:
            self.join(10)
            assert isinstance(self.error, elastic.WorkerLostError) and self.error.reason == "aborted", self.error
        self.comm.close()


@contextmanager
def _rank_1(**listener_kw):
    """Rank 1 of a 2-rank world on a listener of its own, ready to form (call .start()); its
    own connection goes to a listener that never forms, so it waits there until the end."""
    listener = elastic.Listener("127.0.0.1", 0, **listener_kw)
    elsewhere = elastic.Listener("127.0.0.1", 0)
    config = elastic.CommConfig(timeout=30, form_timeout=30)
    former = _Former(elastic.Communicator(
        _native.Communicator(listener, JOB, SECRET, VERSION, 1, [elsewhere.address, listener.address],
                             config.to_native()), config))
    host, port = listener.address.rsplit(":", 1)
    try:
        yield listener, (host, int(port)), former
    finally:
        former.stop()
        listener.close()
        elsewhere.close()


def _still_open(sock) -> bool:
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except ConnectionError:
        return False
    finally:
        sock.settimeout(timeout)


def test_a_full_listener_drops_the_newest_strays_not_the_neighbour_halfway_through():
    # The neighbour's HELLO arrives before this worker forms (it waits, unauthenticated); then
    # a burst of silent strays fills the pending table. Dropping the oldest would drop it.
    with _rank_1(handshake_timeout=60) as (listener, address, former):
        neighbour = socket.create_connection(address, timeout=10)
        strays = []
        try:
            body = _hello()
            neighbour.sendall(msg(HELLO, body))
            for _ in range(200):  # more than the 128 the listener keeps pending
                strays.append(socket.create_connection(address, timeout=10))
            wait_until(lambda: listener.refusal_count >= 200 + 1 - 128, 20,
                       "the listener to drop the strays beyond its limit")
            assert all("dropped: too many handshakes" in r for r in listener.refusals())
            assert _still_open(neighbour), "the neighbour halfway through its handshake was dropped"
            former.start()  # this worker starts forming: the waiting neighbour gets its ACK now
            mtype, status, nonce = read_msg(neighbour)
            assert (mtype, status, len(nonce)) == (ACK, OK, 16)
            neighbour.sendall(msg(PROOF, mac(SECRET, b"connector", body, nonce)))
            assert read_msg(neighbour) == (RESULT, OK, mac(SECRET, b"acceptor", body, nonce))
        finally:
            for sock in strays + [neighbour]:
                sock.close()


def _acked(address) -> bool:
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(msg(HELLO, _hello(job="probe")))
        s.settimeout(0.5)
        try:
            answer = read_msg(s)
        except socket.timeout:
            return False
        return answer is not None and answer[:2] == (ACK, OK)


def test_a_claimed_job_id_is_logged_escaped_and_cut():
    with _rank_1() as (listener, address, former):
        former.start()  # the listener now expects rank 0, so a HELLO gets its ACK
        wait_until(lambda: _acked(address), 10, "the listener to expect its predecessor")
        evil = b"\x1b[2J\x1b[31mpwned\x07\nelastic-ring: forged line " + b"x" * 200
        with socket.create_connection(address, timeout=10) as s:
            s.sendall(msg(HELLO, _hello(job=evil)))
            read_msg(s)
            s.sendall(msg(PROOF, bytes(32)))
            read_msg(s)
        line = wait_until(lambda: next((r for r in listener.refusals() if "pwned" in r), None), 10,
                          "the refusal to be recorded")
        assert "\x1b" not in line and "\n" not in line and "\x07" not in line, line
        assert "\\x1b[2J\\x1b[31mpwned\\x07\\x0aelastic-ring: forged line" in line, line
        assert f"...({len(evil)} bytes)" in line and "x" * 100 not in line, line
