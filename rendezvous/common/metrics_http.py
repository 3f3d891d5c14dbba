"""`/metrics` over HTTP for the rendezvous server and the launcher, on one thread that no client
can exhaust.

prometheus-client's ``start_http_server`` gives every connection a thread and reads with no
timeout: another local user holding a thousand idle connections pins a thousand threads and
descriptors, and at the usual limit of 1,024 open files the launcher's next respawn (or the
server's next accepted RPC) fails. Here one thread serves every connection with non-blocking
sockets, and what a client can hold is bounded:

- at most ``MAX_CONNECTIONS`` are open at once; one more evicts the oldest connection that has
  not sent its whole request yet (a scraper sends it at once: the idle ones are the flood), or is
  closed at once when every open one is being answered;
- the request head must arrive within ``READ_TIMEOUT_S`` of the connection and be at most
  ``MAX_REQUEST_BYTES``; the answer must be taken within ``WRITE_TIMEOUT_S``; else it is closed;
- when the process is out of descriptors, accepting pauses (``ACCEPT_PAUSE_S``) instead of spinning.

``GET /metrics`` (or ``/``) answers the registry in Prometheus text, or OpenMetrics when the
``Accept`` header asks for it (prometheus-client's own encoders); one request per connection.
"""
from __future__ import annotations

import collections
import errno
import selectors
import socket
import threading
import time
from typing import Optional, Tuple

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

MAX_CONNECTIONS = 32
MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 10.0
ACCEPT_PAUSE_S = 0.1


class _Conn:
    __slots__ = ("sock", "deadline", "head", "out", "sent")

    def __init__(self, sock: socket.socket, now: float):
        self.sock = sock
        self.deadline = now + READ_TIMEOUT_S
        self.head = bytearray()
        self.out: Optional[bytes] = None   # the answer, once the request is whole
        self.sent = 0


def parse_request(head: bytes) -> Tuple[str, str, str]:
    """(method, path without the query, Accept header) of a request head; ValueError if it is none."""
    lines = head.split(b"\r\n") if b"\r\n" in head else head.split(b"\n")
    parts = lines[0].split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise ValueError("not an HTTP/1.x request line")
    accept = ""
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"accept":
            accept = value.strip().decode("latin-1")
    return parts[0].decode("latin-1"), parts[1].split(b"?", 1)[0].decode("latin-1"), accept


def _response(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8",
              head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode("latin-1")
    return head if head_only else head + body


class MetricsServer:
    """Serves ``registry`` on ``host:port`` (0: a free port) from a daemon thread; ``close()`` stops it."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, *, name: str = "metrics-http"):
        self._registry = registry
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._conns: "collections.OrderedDict[int, _Conn]" = collections.OrderedDict()   # by accept order
        self._accept_paused_until = 0.0
        self._stop = threading.Event()
        self.evicted = 0   # connections closed to make room or for their deadline (for tests and logs)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(5)
        for c in list(self._conns.values()):
            self._drop(c)
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            self._expire(now)
            if self._accept_paused_until and now >= self._accept_paused_until:
                self._accept_paused_until = 0.0
                self._sel.register(self._listener, selectors.EVENT_READ, None)
            waits = [c.deadline for c in self._conns.values()]
            if self._accept_paused_until:
                waits.append(self._accept_paused_until)
            timeout = max(0.0, min(waits) - now) if waits else None
            for key, events in self._sel.select(timeout):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    return
                elif events & selectors.EVENT_READ:
                    self._read(key.data)
                elif events & selectors.EVENT_WRITE:
                    self._write(key.data)

    def _expire(self, now: float) -> None:
        for c in [c for c in self._conns.values() if c.deadline <= now]:
            self.evicted += 1
            self._drop(c)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: stop asking until some are freed, instead of spinning.
                    self._sel.unregister(self._listener)
                    self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S
                    return
                continue   # the client went away (ECONNABORTED …)
            if len(self._conns) >= MAX_CONNECTIONS and not self._make_room():
                sock.close()
                continue
            sock.setblocking(False)
            c = _Conn(sock, time.monotonic())
            self._conns[sock.fileno()] = c
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _make_room(self) -> bool:
        """Closes the oldest connection still sending its request; False when none is."""
        for c in self._conns.values():
            if c.out is None:
                self.evicted += 1
                self._drop(c)
                return True
        return False

    def _drop(self, c: _Conn) -> None:
        self._conns.pop(c.sock.fileno(), None)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            self._drop(c)
            return
        if not data:
            self._drop(c)
            return
        c.head += data
        end = c.head.find(b"\r\n\r\n")
        if end < 0:
            end = c.head.find(b"\n\n")
        if end < 0:
            if len(c.head) > MAX_REQUEST_BYTES:
                self._answer(c, _response("431 Request Header Fields Too Large", b"request too large\n"))
            return
        self._answer(c, self._respond(bytes(c.head[:end])))

    def _respond(self, head: bytes) -> bytes:
        try:
            method, path, accept = parse_request(head)
        except ValueError:
            return _response("400 Bad Request", b"bad request\n")
        if method not in ("GET", "HEAD"):
            return _response("405 Method Not Allowed", b"only GET\n")
        if path not in ("/metrics", "/"):
            return _response("404 Not Found", b"metrics are at /metrics\n")
        encoder, content_type = choose_encoder(accept)
        try:
            body = encoder(self._registry)
        except Exception as e:   # a collector failed: say so, keep serving
            return _response("500 Internal Server Error", f"collecting metrics failed: {type(e).__name__}\n".encode())
        return _response("200 OK", body, content_type, head_only=method == "HEAD")

    def _answer(self, c: _Conn, out: bytes) -> None:
        c.out, c.sent = out, 0
        c.deadline = time.monotonic() + WRITE_TIMEOUT_S
        self._sel.modify(c.sock, selectors.EVENT_WRITE, c)
        self._write(c)

    def _write(self, c: _Conn) -> None:
        try:
            n = c.sock.send(memoryview(c.out)[c.sent:])
        except BlockingIOError:
            return
        except OSError:
            self._drop(c)
            return
        c.sent += n
        if c.sent >= len(c.out):
            try:
                c.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._drop(c)
