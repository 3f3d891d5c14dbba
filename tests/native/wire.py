"""The ring handshake (protocol 4, native/README.md "Wire format") spoken by hand, for tests that
play a stranger, an impostor or a squatter at a ring port."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import threading
from typing import Callable, Optional

MAGIC, PROTO = 0x45524E47, 4
HELLO, ACK, PROOF, RESULT = 1, 2, 3, 4
OK, NOT_READY, REFUSED = 0, 1, 2
NO_SUCH_RING = 6  # the refusal code of "this worker forms no such ring"


def msg(mtype: int, body: bytes, status: int = OK, proto: int = PROTO) -> bytes:
    return struct.pack(">IHBBI", MAGIC, proto, mtype, status, len(body)) + body


def read_msg(sock):
    """(type, status, body) of the next message, or None if the connection closed first."""
    def exact(n):
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data
    hdr = exact(12)
    if hdr is None:
        return None
    magic, proto, mtype, status, length = struct.unpack(">IHBBI", hdr)
    assert magic == MAGIC and proto == PROTO, (magic, proto)
    body = exact(length)
    return None if body is None else (mtype, status, body)


def hello_body(job, version: int, from_rank: int, to_rank: int, size: int, channel: int = 0,
               digest: bytes = bytes(32)) -> bytes:
    """A HELLO body; `digest` names the world (elastic.ring.ring_view.list_digest of a ring formed by hand)."""
    job_b = job.encode() if isinstance(job, str) else job
    return struct.pack(">QIIIB", version, from_rank, to_rank, size, channel) + digest + bytes(16) + \
        struct.pack(">H", len(job_b)) + job_b


def mac(secret: bytes, role: bytes, body: bytes, nonce: bytes, extra: bytes = b"") -> bytes:
    """The handshake MAC of `role` ("connector", "acceptor", "refusal") over HELLO body, nonce, extra."""
    return hmac.new(secret, b"elastic-ring handshake v3:" + role + b"\0" + body + nonce + extra,
                    hashlib.sha256).digest()


def refusal(code: int, reason: bytes, signed_with: Optional[bytes], body: bytes, nonce: bytes) -> bytes:
    """A RESULT REFUSED body, its MAC made with `signed_with` (None: all zero, proving nothing)."""
    head = struct.pack(">BH", code, len(reason)) + reason
    return head + (mac(signed_with, b"refusal", body, nonce, head) if signed_with is not None else bytes(32))


def read_refusal(answer: bytes, secret: bytes, body: bytes, nonce: bytes):
    """(code, reason, whether its MAC proves `secret`) of a RESULT REFUSED body."""
    code, length = struct.unpack(">BH", answer[:3])
    reason, tag = answer[3:3 + length], answer[3 + length:]
    assert len(tag) == 32
    return code, reason.decode(), hmac.compare_digest(tag, mac(secret, b"refusal", body, nonce, answer[:3 + length]))


def closed_port_address() -> str:
    """A loopback address nobody listens at (bound for a moment, then let go)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    address = "127.0.0.1:%d" % s.getsockname()[1]
    s.close()
    return address


class FakeListener:
    """Listens on loopback and hands every connection to `serve(conn)` on its own thread, in turn."""

    def __init__(self, serve: Callable[[socket.socket], None]):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.serve = serve
        self.connections = 0
        self.errors = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            self.connections += 1
            conn.settimeout(5)
            try:
                self.serve(conn)
            except (OSError, AssertionError) as e:  # a test's script went wrong: it checks .errors
                self.errors.append(e)
                conn.close()

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def refuse_after_proof(reason: bytes, signed_with: Optional[bytes], code: int = NO_SUCH_RING):
    """A `serve` for FakeListener: ACK the HELLO, read the PROOF, refuse with `reason`."""
    def serve(conn):
        with conn:
            _, _, body = read_msg(conn)
            nonce = bytes(range(16))
            conn.sendall(msg(ACK, nonce))
            read_msg(conn)
            conn.sendall(msg(RESULT, refusal(code, reason, signed_with, body, nonce), REFUSED))
    return serve
