"""The worker side of the rendezvous: join a job, follow its worlds, report, leave.

Used by the training runtime (elastic/); blocking API, one background thread per client follows the
Watch stream. Every call and wait takes a deadline. Calls go to the configured server addresses in
turn: an address that is down, or a replica that is not the leader (UNAVAILABLE, with a `leader` hint
that is tried next), costs one backoff step, never an error, until the call's deadline.

    client = RendezvousClient(["10.0.0.1:29400", "10.0.0.2:29400"], job_id="job", worker_id="w0",
                              host="node1", ring_address="10.0.0.5:41000", token=token,
                              spec=JobSpec(min_np=2, max_np=8))
    client.join(committed_step=-1)                   # client.ring_secret: the job's ring secret
    world = client.wait_world(timeout_s=60)          # WorldInfo: version, rank, size, members, …
    ev = client.next_event(timeout_s=0.0)            # World / Pending / Abort / Standby / Finished / Ended
    client.heartbeat(committed_step=120)             # optional: progress picks rank 0 of the next world
    client.report_failure("w3", world.version)       # a peer broke; the server checks it at once
    client.leave()                                   # or client.report_success()
    client.close()

How the runtime reads the events: after `Abort(V)` a member of V failed, so abort what is in flight
and form the ring of the next `WorldInfo`; after `Pending(V)` a clean join/leave is coming, so keep
training in V and move to the next `WorldInfo` at a commit boundary every member agrees on. A
`Standby` worker waits for a world that includes it. `Ended` means the server no longer knows this
session (it was evicted, e.g. after being stopped longer than the heartbeat timeout): join again.

How the job ended comes typed, never as text to parse: a `Finished` event while watching; and when
this worker learns it only from a refusal (its session ended with the job, or a Join came after the
end), `Ended.finished` and `RendezvousRPCError.finished` are True (succeeded) or False (failed),
from the server's `elastic-job-outcome` trailing metadata. None means "not because the job is over".

TLS: `channel_credentials(ca, cert, key)` reads the PEM files once (a clear ValueError naming the
flag or variable if one is unreadable) and is what every client of the service uses: workers, the
launcher's Status polls, `elastic-rendezvous status`, and the rendezvous server's etcd connection.
With a CA the channel is TLS and never falls back to plaintext, so a token sent on it only crosses
TLS; a certificate and key are presented to servers that require client certificates.

Liveness needs nothing from the caller: the open Watch stream plus gRPC keepalive (answered by gRPC's
C core, without the GIL) tell the server this process is alive.

Sessions are numbered: `join()` starts a new one, empties the event queue, and events still arriving
from the replaced session (its stream being closed, a stale `Ended`) are dropped, under the same lock
that pushes them. A World with the same version as the last one but different members counts as new.

A session id is a capability (the server refuses made-up ones), so it stays inside this object; a
join() after the first sends the previous one as proof that this is the worker of that id. The
ring secret from the Join answer is what the ring handshake authenticates with: hand it only to
the Communicator.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import queue
import random
import threading
import time
from typing import Callable, Optional, Sequence, Union

import grpc

from . import wire
from ._proto import rendezvous_pb2 as pb
from ._proto import rendezvous_pb2_grpc as pb_grpc
from .decision import DEFAULT_MAX_NP, JobSpec, Member

log = logging.getLogger("rendezvous.client")

# Codes after which trying again (elsewhere, a bit later) can succeed. Not INTERNAL/UNKNOWN: those
# are server bugs, and repeating the request would repeat them.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED)
# Codes a server answers a caller it refuses with: retrying with the same credentials is pointless.
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
_MIN_RING_SECRET = 16   # bytes; a server that sends less is not one this client can trust


class RendezvousRPCError(RuntimeError):
    """A rendezvous call failed for good; `code` is the gRPC status code (None: no server reached).
    `finished` is True/False when it was refused because the job succeeded/failed, else None."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None, *,
                 finished: Optional[bool] = None):
        super().__init__(message)
        self.code = code
        self.finished = finished


@dataclasses.dataclass(frozen=True)
class WorldInfo:
    """A world this worker is a member of."""

    version: int
    members: tuple[Member, ...]
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


@dataclasses.dataclass(frozen=True)
class Pending:
    """A clean join/leave is coming: switch to the next world at a commit boundary."""

    world_version: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Abort:
    """A member of `world_version` failed: abort what is in flight and wait for the next world."""

    world_version: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Standby:
    world_version: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Finished:
    succeeded: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class Ended:
    """This session is over (evicted, replaced, or no server reachable): join again or give up.
    `finished` is True/False when it ended because the job succeeded/failed (join no more)."""

    reason: str
    finished: Optional[bool] = None


Event = Union[WorldInfo, Pending, Abort, Standby, Finished, Ended]


def channel_options(keepalive_s: float = 1.0) -> list[tuple[str, int]]:
    """gRPC channel options of a worker: ping the server every `keepalive_s` to notice a dead or
    stopped server within about 3x that and reconnect elsewhere; no transparent retries (ours
    fail over across addresses instead)."""
    return [
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_s * 2000)),
        ("grpc.http2.ping_timeout_ms", int(keepalive_s * 2000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 0),
    ]


# What a PEM file may hold at most: a long chain is a few tens of KiB; more is not a PEM file.
_PEM_MAX_BYTES = 1 << 20


def _read_bounded(path: str, what: str, limit: int, too_large: str) -> bytes:
    """At most `limit` bytes of the file at `path`; ValueError naming `what` (its flag or
    variable) when it cannot be read or is larger, `too_large` saying what it should be."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror}") from None
    if len(raw) > limit:
        raise ValueError(f"{what} {path} is larger than {limit} bytes: {too_large}")
    return raw


def read_pem(path: str, what: str) -> bytes:
    """The PEM file at `path`; ValueError naming `what` (its flag or variable) if it is unreadable,
    too large or holds no PEM block (gRPC would only fail later, at connect, without naming it)."""
    data = _read_bounded(path, what, _PEM_MAX_BYTES, "not a PEM file")
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path} is not a PEM file (no '-----BEGIN' line)")
    return data


def channel_credentials(ca: Optional[str], cert: Optional[str] = None, key: Optional[str] = None,
                        *, names: Sequence[str] = ("--tls-ca", "--tls-cert", "--tls-key")
                        ) -> Optional[grpc.ChannelCredentials]:
    """TLS credentials of a client: trust the CA certificate(s) in `ca`, and present the client
    certificate `cert` with its private key `key` when given (servers started with a client CA
    require one). None without `ca`: a plaintext channel. `names` are how the caller calls the three
    files (flags or variables), for the errors: unreadable files, a cert without its key, a client
    certificate without a CA (it would never be sent)."""
    ca_name, cert_name, key_name = names
    if not ca:
        if cert or key:
            raise ValueError(f"{cert_name if cert else key_name} needs {ca_name}: a client "
                             "certificate is only presented over TLS")
        return None
    if bool(cert) != bool(key):
        raise ValueError(f"{cert_name} and {key_name} must be given together")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, ca_name),
        private_key=read_pem(key, key_name) if key else None,
        certificate_chain=read_pem(cert, cert_name) if cert else None)


def open_channel(address: str, credentials: Optional[grpc.ChannelCredentials] = None,
                 options: Sequence[tuple[str, int]] = ()) -> grpc.Channel:
    """A channel to `address`: TLS with `credentials` (from `channel_credentials`), else plaintext."""
    if credentials is not None:
        return grpc.secure_channel(address, credentials, options=list(options))
    return grpc.insecure_channel(address, options=list(options))


def parse_addresses(text: str, what: str) -> tuple[str, ...]:
    """A comma-separated `HOST:PORT[,HOST:PORT...]` list (blanks ignored); ValueError naming `what`
    for an entry that is not HOST:PORT with a port in 1..65535, or for an empty list."""
    out = tuple(a.strip() for a in text.split(",") if a.strip())
    if not out:
        raise ValueError(f"{what} needs HOST:PORT[,HOST:PORT...]")
    for a in out:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{what}: {a!r} is not HOST:PORT")
    return out


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine only;
    wildcards (0.0.0.0, ::, empty) and other names are not."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False




_TOKEN_RULE = "a token is up to 4096 printable ASCII characters"


def _check_token(token: bytes, what: str, path: str) -> str:
    if len(token) > 4096 or any(b < 0x20 or b > 0x7e for b in token):
        raise ValueError(f"{what} {path} must hold tokens of up to 4096 printable ASCII characters")
    return token.decode("ascii")


def read_token_file(path: str, what: str) -> str:
    """The token in the file at `path` (surrounding whitespace dropped); ValueError naming `what`
    when it is unreadable, empty, or holds what an HTTP/2 header cannot carry."""
    token = _read_bounded(path, what, 4096, _TOKEN_RULE).strip()
    if not token:
        raise ValueError(f"{what} {path} is empty")
    return _check_token(token, what, path)


def read_token_list(path: str, what: str) -> tuple[str, ...]:
    """The tokens a server accepts: one a line, blank lines ignored, so a one-token file works
    as is. ValueError naming `what` when the file is unreadable, holds none, or a bad one."""
    lines = (line.strip() for line in _read_bounded(path, what, 1 << 20, _TOKEN_RULE).splitlines())
    tokens = tuple(dict.fromkeys(_check_token(t, what, path) for t in lines if t))
    if not tokens:
        raise ValueError(f"{what} {path} is empty")
    return tokens


def _world(w: pb.World) -> WorldInfo:
    members = tuple(wire.member_from_pb(m) for m in w.members)
    return WorldInfo(w.version, members, w.rank, w.size, w.local_rank, w.local_size, w.cross_rank,
                     w.cross_size)


class RendezvousClient:
    def __init__(self, addresses: Sequence[str], *, job_id: str, worker_id: str, host: str,
                 ring_address: str, token: Optional[str] = None, spec: JobSpec = JobSpec(),
                 spec_if_new: Optional[JobSpec] = None, tls_root_cert: Optional[bytes] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None, rpc_timeout_s: float = 5.0,
                 reconnect_timeout_s: float = 30.0, backoff_max_s: float = 1.0,
                 keepalive_s: float = 1.0):
        if not addresses:
            raise ValueError("RendezvousClient needs at least one HOST:PORT server address")
        self.addresses = list(addresses)
        self.job_id, self.worker_id, self.host = job_id, worker_id, host
        self.ring_address = ring_address
        # `spec`: the limits this worker insists on, 0 for "the job's"; `spec_if_new`: its limits
        # where `spec` leaves them 0, should this join create the job (see protos/rendezvous.proto).
        self.spec, self.spec_if_new = spec, spec_if_new
        self.rpc_timeout_s = rpc_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.backoff_max_s = backoff_max_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        # `credentials` (channel_credentials(ca, cert, key)) or, shorter, just a CA certificate.
        self._creds = credentials or (grpc.ssl_channel_credentials(tls_root_cert) if tls_root_cert
                                      else None)
        self._options = channel_options(keepalive_s)
        self._channels: dict[str, grpc.Channel] = {}
        self._current = 0
        self._lock = threading.Lock()
        self._events: "queue.Queue[Event]" = queue.Queue()
        self.session_id: Optional[str] = None
        self.ring_secret: Optional[bytes] = None      # the job's ring secret, from the Join answer
        self.world: Optional[WorldInfo] = None        # the latest world received
        self._closed = threading.Event()
        self._watch_thread: Optional[threading.Thread] = None
        self._watch_call = None
        # Guards the session number, session id, event queue pushes and the watching flag.
        self._session = threading.Condition()
        self._gen = 0                       # session number: bumped by every join()
        self._watching = False              # a watch thread runs (or is about to) for this client
        self._committed_step = -1           # resent on every (re)attach: the server keeps it soft
        self._last_world_key = None         # (version, members) of the last pushed world
        self._last_abort: Optional[int] = None
        self._last: Optional[Event] = None

    # ----------------------------------------------------------------------------- plumbing
    def _stub(self, address: str) -> pb_grpc.RendezvousStub:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = open_channel(address, self._creds, self._options)
                self._channels[address] = ch
            return pb_grpc.RendezvousStub(ch)

    def _next_address(self, hint: str = "") -> None:
        with self._lock:
            if hint and hint in self.addresses:
                self._current = self.addresses.index(hint)
            else:
                self._current = (self._current + 1) % len(self.addresses)

    def _call(self, method: str, request, timeout_s: Optional[float] = None, *,
              attempt_s: Optional[float] = None, done_if_retried=(), again_if_retried=()):
        """Unary call with failover across addresses and backoff, until `timeout_s` runs out.

        `done_if_retried`: status codes that, on a retry after an attempt whose outcome is unknown
        (DEADLINE_EXCEEDED, CANCELLED), mean the first attempt took effect (returns None then).
        `again_if_retried`: codes that, after such an attempt, are retried with backoff (the first
        attempt's effect clears by itself).
        """
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.rpc_timeout_s)
        attempt_s = attempt_s or self.rpc_timeout_s
        backoff, tried, last, unsure = 0.02, 0, None, False
        while True:
            address = self.addresses[self._current]
            remaining = deadline - time.monotonic()
            try:
                return getattr(self._stub(address), method)(
                    request, timeout=max(0.05, min(remaining, attempt_s)),
                    metadata=self._metadata)
            except grpc.RpcError as e:
                if unsure and e.code() in done_if_retried:
                    return None
                if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                    unsure = True
                if e.code() not in _RETRYABLE and not (unsure and e.code() in again_if_retried):
                    raise RendezvousRPCError(
                        f"{method} to {address} for job {self.job_id} worker {self.worker_id}: "
                        f"{e.code().name}: {e.details()}", e.code(),
                        finished=wire.job_outcome(e.trailing_metadata())) from None
                last = f"{address}: {e.code().name}: {e.details()}"
                self._next_address(wire.leader_hint(e.trailing_metadata()))
            tried += 1
            if time.monotonic() + backoff > deadline:
                raise RendezvousRPCError(f"{method} for job {self.job_id} worker {self.worker_id}: no "
                                         f"rendezvous server answered within the deadline ({tried} "
                                         f"attempt(s) over {self.addresses}); last: {last}",
                                         grpc.StatusCode.UNAVAILABLE)
            if tried % len(self.addresses) == 0:
                time.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, self.backoff_max_s)

    # --------------------------------------------------------------------------------- API
    def join(self, committed_step: int = -1, timeout_s: float = 30.0) -> str:
        """Join the job (creating it with `spec` if new) and start following it; returns the session.

        Joining again (e.g. after an `Ended` event) replaces the previous session: the event queue is
        emptied and nothing from the old session is delivered any more. The previous session id is
        sent along: the server lets a worker id that is still registered join again only with it.
        """
        with self._session:
            self._gen += 1
            old_sid, self.session_id = self.session_id, None   # the watch thread pauses meanwhile
            self._committed_step = max(self._committed_step, committed_step)
        try:
            # A Join whose first attempt timed out may have registered a session we never learnt:
            # the retry is then refused ALREADY_EXISTS until that session, never watched, is
            # evicted (the server's heartbeat timeout), so keep retrying within the deadline.
            resp = self._call("Join", pb.JoinRequest(
                job_id=self.job_id, worker_id=self.worker_id, host=self.host,
                ring_address=self.ring_address, committed_step=committed_step,
                spec=wire.spec_pb(self.spec), session_id=old_sid or "",
                spec_if_new=wire.spec_pb(self.spec_if_new) if self.spec_if_new else None), timeout_s,
                again_if_retried=(grpc.StatusCode.ALREADY_EXISTS,))
            if len(resp.ring_secret) < _MIN_RING_SECRET:
                raise RendezvousRPCError(f"Join for job {self.job_id} worker {self.worker_id}: the "
                                         f"server sent no ring secret ({len(resp.ring_secret)} "
                                         f"bytes); it is too old for this client")
        except BaseException:
            with self._session:
                if self.session_id is None:
                    self.session_id = old_sid
                self._session.notify_all()
            raise
        with self._session:
            self.session_id = resp.session_id
            self.ring_secret = resp.ring_secret
            self._drain_queue()
            self._last_world_key = self._last_abort = self._last = None
            self.world = None
            start = not self._watching
            self._watching = True
            self._session.notify_all()
            call = self._watch_call
        if call is not None and old_sid is not None:
            call.cancel()   # stop reading the replaced session's stream now
        if start:
            if self._watch_thread is not None and self._watch_thread is not threading.current_thread():
                self._watch_thread.join(timeout=5.0)
            self._watch_thread = threading.Thread(target=self._watch_loop, daemon=True,
                                                  name=f"rdzv-watch-{self.worker_id}")
            self._watch_thread.start()
        return resp.session_id

    def _drain_queue(self) -> None:
        while True:
            try:
                self._events.get_nowait()
            except queue.Empty:
                return

    def next_event(self, timeout_s: float) -> Optional[Event]:
        """The next event from the server, or None if none arrives within `timeout_s`."""
        try:
            return self._events.get(timeout=max(0.0, timeout_s)) if timeout_s > 0 else \
                self._events.get_nowait()
        except queue.Empty:
            return None

    def wait_world(self, timeout_s: float, min_version: int = 1) -> WorldInfo:
        """Block until a world with version >= min_version that includes this worker arrives.

        Other events are consumed. Raises RendezvousRPCError on Finished/Ended (its `finished` says
        whether the job is over and how), TimeoutError on the deadline (standby workers simply keep
        waiting).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            ev = self.next_event(deadline - time.monotonic())
            if ev is None:
                raise TimeoutError(f"job {self.job_id} worker {self.worker_id}: no world >= "
                                   f"{min_version} within {timeout_s} s")
            if isinstance(ev, WorldInfo) and ev.version >= min_version:
                return ev
            if isinstance(ev, Finished):
                raise RendezvousRPCError(f"job {self.job_id} finished: {ev.reason}",
                                         finished=ev.succeeded)
            if isinstance(ev, Ended):
                raise RendezvousRPCError(f"job {self.job_id} worker {self.worker_id}: {ev.reason}",
                                         finished=ev.finished)

    def heartbeat(self, committed_step: int = -1, timeout_s: float = 1.0) -> int:
        """Report the last committed step; returns the server's current world version.

        Short default deadline: callers send it from their event loop, which must not stall for long
        during a server outage (the step is resent on the next call and on reattach anyway).
        """
        if committed_step > self._committed_step:
            self._committed_step = committed_step
        return self._call("Heartbeat", pb.HeartbeatRequest(session_id=self._sid(),
                                                           committed_step=committed_step),
                          timeout_s).world_version

    def report_failure(self, suspect_worker_id: str, world_version: int, reason: str = "",
                       unusable_address: bool = False, timed_out: bool = False) -> bool:
        """Tell the server a peer broke; returns True if the server evicted it. ``unusable_address``:
        its ring address leads to no member of this job, so the server evicts it even if it is alive.
        ``timed_out``: the collective timed out waiting on it (it may be alive and busy)."""
        return self._call("ReportFailure", pb.ReportFailureRequest(
            session_id=self._sid(), world_version=world_version,
            suspect_worker_id=suspect_worker_id, reason=reason, unusable_address=unusable_address,
            timed_out=timed_out),
            # The server may wait up to its heartbeat timeout for the suspect's stream to break.
            timeout_s=max(30.0, self.rpc_timeout_s), attempt_s=max(15.0, self.rpc_timeout_s)).evicted

    def report_success(self, world_version: Optional[int] = None) -> None:
        """This worker finished: the job completes for everyone.

        The server takes it only from a member of `world_version` (default: the latest world this
        client received); a worker that never was in a world cannot end the job."""
        if world_version is None:
            world_version = self.world.version if self.world is not None else 0
        # Retried after an unknown outcome, FAILED_PRECONDITION means the job already finished.
        # Retried as long as a reconnect: lost to a leader change, the success would turn into
        # a job failure once the workers are gone.
        self._call("ReportSuccess", pb.ReportSuccessRequest(session_id=self._sid(),
                                                            world_version=world_version),
                   max(3 * self.rpc_timeout_s, self.reconnect_timeout_s),
                   done_if_retried=(grpc.StatusCode.FAILED_PRECONDITION,))

    def leave(self) -> None:
        """Leave cleanly (the others see a membership change, not a failure) and stop watching."""
        try:
            # Retried after an unknown outcome, NOT_FOUND means the first attempt removed us.
            self._call("Leave", pb.LeaveRequest(session_id=self._sid()), 3 * self.rpc_timeout_s,
                       done_if_retried=(grpc.StatusCode.NOT_FOUND,))
        finally:
            self.close()

    def close(self) -> None:
        """Stop the watch thread and close connections (without leaving: the server evicts us)."""
        self._closed.set()
        with self._session:
            self._session.notify_all()
        call = self._watch_call
        if call is not None:
            call.cancel()
        if self._watch_thread is not None and self._watch_thread is not threading.current_thread():
            self._watch_thread.join(timeout=5.0)
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()

    def _sid(self) -> str:
        if self.session_id is None:
            raise RendezvousRPCError(f"worker {self.worker_id}: join() first")
        return self.session_id

    # --------------------------------------------------------------------------- watching
    def _watch_loop(self) -> None:
        backoff, down_since = 0.02, None
        while not self._closed.is_set():
            with self._session:
                while self.session_id is None and not self._closed.is_set():
                    self._session.wait(0.5)    # a join() is replacing the session
                sid, gen = self.session_id, self._gen
            if sid is None:
                break
            address = self.addresses[self._current]
            try:
                call = self._stub(address).Watch(
                    pb.WatchRequest(session_id=sid, committed_step=self._committed_step),
                    metadata=self._metadata)
                self._watch_call = call
                for ev in call:
                    down_since, backoff = None, 0.02
                    self._handle(ev, address, gen)
                if self._closed.is_set():
                    break
                # The server ended the stream: after Finished, or on graceful shutdown / stepping
                # down as leader (then another replica is the better bet).
                if isinstance(self._last, Finished) and self._stop_if(gen):
                    return
                self._next_address()
            except grpc.RpcError as e:
                if self._closed.is_set():
                    break
                code = e.code()
                if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT):
                    ended = Ended(f"{code.name}: {e.details()}",
                                  finished=wire.job_outcome(e.trailing_metadata()))
                    if self._push(ended, gen) and self._stop_if(gen):
                        return
                    continue  # a join() replaced the session while we watched the old one
                self._next_address(wire.leader_hint(e.trailing_metadata()))
            down_since = down_since or time.monotonic()
            if time.monotonic() - down_since > self.reconnect_timeout_s:
                if self._push(Ended(f"no rendezvous server reachable for "
                                    f"{self.reconnect_timeout_s:g} s (tried {self.addresses})"),
                              gen) and self._stop_if(gen):
                    return
                down_since = None
                continue
            self._closed.wait(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, self.backoff_max_s)
        with self._session:
            self._watching = False

    def _stop_if(self, gen: int) -> bool:
        """End the watch thread if session `gen` is still current (the next join() starts another)."""
        with self._session:
            if gen != self._gen:
                return False
            self._watching = False
            return True

    def _push(self, ev: Event, gen: int) -> bool:
        """Queue `ev` if it belongs to the current session; False if the session was replaced."""
        with self._session:
            if gen != self._gen:
                return False
            self._last = ev
            self._events.put(ev)
            return True

    def _handle(self, ev: pb.WatchEvent, address: str, gen: int) -> None:
        kind = ev.WhichOneof("event")
        if kind == "probe":
            # Answer at once, from this thread: proof that this process is alive and not wedged.
            try:
                self._stub(address).Heartbeat(pb.HeartbeatRequest(
                    session_id=self.session_id, committed_step=-1, probe_nonce=ev.probe.nonce),
                    timeout=self.rpc_timeout_s, metadata=self._metadata)
            except grpc.RpcError as e:
                log.warning("worker %s: answering probe failed: %s", self.worker_id, e.details())
        elif kind == "world":
            world = _world(ev.world)
            key = (world.version, world.members)
            with self._session:
                if gen != self._gen:
                    return
                self.world = world
                # A reattach resends the snapshot: skip it if it is exactly the world we have; a
                # world of the same version with other members is new.
                if key != self._last_world_key:
                    self._last_world_key = key
                    self._last = world
                    self._events.put(world)
        elif kind == "pending":
            self._push(Pending(ev.pending.world_version, ev.pending.reason), gen)
        elif kind == "abort":
            with self._session:
                if gen != self._gen or self._last_abort == ev.abort.world_version:
                    return
                self._last_abort = ev.abort.world_version
                self._last = ev = Abort(ev.abort.world_version, ev.abort.reason)
                self._events.put(ev)
        elif kind == "standby":
            self._push(Standby(ev.standby.world_version, ev.standby.reason), gen)
        elif kind == "finished":
            self._push(Finished(ev.finished.succeeded, ev.finished.reason), gen)


# ------------------------------------------------------------------------------------- Status
# What the service says about jobs, for whoever only watches them: the launcher (`elastic-run`
# follows its job's worlds, ranks and end) and `elastic-rendezvous status`. Answers are plain
# dataclasses; nothing outside this package sees the generated messages.

@dataclasses.dataclass(frozen=True)
class MemberStatusInfo:
    """One registered worker of a job, as Status shows it."""

    worker_id: str
    host: str
    rank: Optional[int]              # None: on standby (not in the world)
    attached: bool                   # has an open Watch stream on the leader
    committed_step: int
    ring_address: str = ""
    local_rank: int = 0              # this and the three below: meaningful in the world only
    local_size: int = 0
    cross_rank: int = 0
    cross_size: int = 0
    age_s: float = 0.0               # seconds since it joined

    @property
    def in_world(self) -> bool:
        return self.rank is not None


@dataclasses.dataclass(frozen=True)
class JobEventInfo:
    """Something that happened to a job, as the answering replica saw it (its text is the
    server's: escape it before showing it on a terminal)."""

    time: float                      # Unix seconds
    event: str                       # world_formed, worker_joined, worker_evicted, …
    world_version: int
    worker_id: str = ""
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class JobStatusInfo:
    """One job in a Status answer."""

    job_id: str
    phase: str                       # FORMING, RUNNING, WAITING (below min_np), SUCCEEDED, FAILED
    reason: str
    world_version: int
    min_np: int
    max_np: int
    elastic_timeout_s: float
    members: tuple[MemberStatusInfo, ...]
    blacklisted_hosts: tuple[str, ...] = ()
    events: tuple[JobEventInfo, ...] = ()    # oldest first, only when asked for

    @property
    def terminal(self) -> bool:
        return self.phase in ("SUCCEEDED", "FAILED")

    def ranks(self) -> dict[str, int]:
        """worker id -> rank, for the members of the current world."""
        return {m.worker_id: m.rank for m in self.members if m.rank is not None}


@dataclasses.dataclass(frozen=True)
class StatusInfo:
    """A whole Status answer."""

    leader_id: str                   # the replica that answered; empty: a follower, from the store
    jobs: tuple[JobStatusInfo, ...]


@dataclasses.dataclass(frozen=True)
class StatusFailure:
    """Why one server gave no Status answer."""

    address: str
    code: grpc.StatusCode
    details: str


class StatusError(RendezvousRPCError):
    """A Status call got no answer: no configured server answered (`failures` says why for each,
    in order), or one said NOT_FOUND (a job it does not know; the others are not asked). `code`
    is the last failure's."""

    def __init__(self, failures: Sequence[StatusFailure]):
        self.failures = tuple(failures)
        several = len(self.failures) > 1
        super().__init__("; ".join(
            (f"{f.address}: " if several else "") + f.code.name
            + (f" ({f.details.splitlines()[0]})" if f.details.strip() else "")
            for f in self.failures), self.failures[-1].code if self.failures else None)

    def refused(self) -> Optional[StatusFailure]:
        """The first server that answered by refusing the caller's credentials (the token, or a
        client certificate TLS let through): no retry will change that."""
        return next((f for f in self.failures if f.code in _REFUSED), None)


def _member_status(m: pb.MemberStatus) -> MemberStatusInfo:
    mm = m.member
    return MemberStatusInfo(mm.worker_id, mm.host, mm.rank if m.in_world else None, m.attached,
                            mm.committed_step, mm.ring_address, mm.local_rank, mm.local_size,
                            mm.cross_rank, mm.cross_size, m.age_s)


def _job_status(j: pb.JobStatus) -> JobStatusInfo:
    return JobStatusInfo(j.job_id, j.phase, j.reason, j.world_version, j.spec.min_np,
                         j.spec.max_np, j.spec.elastic_timeout_s,
                         tuple(_member_status(m) for m in j.members), tuple(j.blacklisted_hosts),
                         tuple(JobEventInfo(e.time, e.event, e.world_version, e.worker_id, e.detail)
                               for e in j.events))


class StatusClient:
    """Status RPCs against the configured servers, trying each in turn (any replica answers: a
    follower reads the store). TLS with `credentials` (from `channel_credentials`); the token, if
    any, goes as `authorization: Bearer` metadata, as for every other call.

        with StatusClient(["10.0.0.1:29400"], token=token, credentials=creds) as status:
            job = status.job("exp7")                 # JobStatusInfo, or None if unknown
            everything = status.status()             # StatusInfo: every job
    """

    def __init__(self, addresses: Sequence[str], token: Optional[str] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None):
        if not addresses:
            raise ValueError("StatusClient needs at least one HOST:PORT server address")
        self.addresses = list(addresses)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channels = {a: open_channel(a, credentials) for a in self.addresses}
        self._stubs = {a: pb_grpc.RendezvousStub(ch) for a, ch in self._channels.items()}

    def status(self, job_id: str = "", timeout_s: float = 2.0, events: int = 0) -> StatusInfo:
        """The first answer from the servers in turn, about `job_id` (empty: every job), with up
        to `events` recent events per job. Raises StatusError when none answers (each gets up to
        `timeout_s`), or with code NOT_FOUND for a job the server does not know."""
        failures = []
        for address in self.addresses:
            try:
                resp = self._stubs[address].Status(pb.StatusRequest(job_id=job_id, events=events),
                                                   timeout=timeout_s, metadata=self._metadata)
            except grpc.RpcError as e:
                failures.append(StatusFailure(address, e.code(), e.details() or ""))
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    break   # an answer: every replica reads the same store
                continue
            return StatusInfo(resp.leader_id, tuple(_job_status(j) for j in resp.jobs))
        raise StatusError(failures)

    def job(self, job_id: str, timeout_s: float = 2.0, events: int = 0) -> Optional[JobStatusInfo]:
        """The job's status (with up to ``events`` recent events); None if the servers do not
        know it (yet). Raises StatusError."""
        try:
            answer = self.status(job_id, timeout_s, events=events)
        except StatusError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        for j in answer.jobs:
            if j.job_id == job_id:
                return j
        return None

    def wait_reachable(self, job_id: str, timeout_s: float,
                       cancelled: Callable[[], bool] = lambda: False) -> Optional[JobStatusInfo]:
        """Like job(), retrying until a server answers, the deadline passes or `cancelled()`. A
        server that refused the caller (UNAUTHENTICATED, PERMISSION_DENIED) answered: raised at once."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.job(job_id, timeout_s=max(0.5, min(2.0, deadline - time.monotonic())))
            except StatusError as e:
                if time.monotonic() >= deadline or cancelled() or e.refused() is not None:
                    raise
            time.sleep(0.2)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()

    def __enter__(self) -> "StatusClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
