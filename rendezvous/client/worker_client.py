"""The worker side of the rendezvous: join a job, follow its worlds, report, leave.

Used by the training runtime (elastic/); blocking API, one background thread per client follows the
Watch stream. Every call and wait takes a deadline. Calls go to the configured server addresses in
turn: an address that is down, or a replica that is not the leader (UNAVAILABLE, with a `leader` hint
that is tried next), costs one backoff step, never an error, until the call's deadline.

    client = RendezvousClient(["10.0.0.1:29400", "10.0.0.2:29400"], job_id="job", worker_id="w0",
                              host="node1", ring_address="10.0.0.5:41000", token=token,
                              spec=JobSpec(min_np=2, max_np=8))
    client.join(commit_step=-1)                      # client.ring_secret: the job's ring secret
    world = client.wait_world(timeout_s=60)          # WorldInfo: version, rank, size, members, …
    ev = client.next_event(timeout_s=0.0)            # World / Pending / Abort / Standby / Finished / Ended
    client.report_progress(commit_step=120)          # optional: progress picks rank 0 of the next world
                                                     # (and straggler=StragglerReport(…): its pace)
    client.report_failure("w3", world.world_version)       # a peer broke; the server checks it at once
    client.leave()                                   # or client.report_success()
    client.close()

What each event means to the runtime is said in watch_events.py.

How the job ended comes typed, never as text to parse: a `Finished` event while watching; and when
this worker learns it only from a refusal (its session ended with the job, or a Join came after the
end), `Ended.finished` and `RendezvousRPCError.finished` are True (succeeded) or False (failed),
from the server's `elastic-job-outcome` trailing metadata. None means "not because the job is over".

Liveness needs nothing from the caller: the open Watch stream plus gRPC keepalive (answered by gRPC's
C core, without the GIL) tell the server this process is alive. The Watch thread answers the
server's probes (AnswerProbe) and acknowledges aborts (AcknowledgeAbort, where the abort asks) by
itself, at once.

Sessions are numbered: `join()` starts a new one, empties the event queue, and events still arriving
from the replaced session (its stream being closed, a stale `Ended`) are dropped, under the same lock
that pushes them. A World with the same version as the last one but different members counts as new.

A session id is a capability (the server refuses made-up ones), so it stays inside this object; a
join() after the first sends the previous one as proof that this is the worker of that id. The
ring secret from the Join answer is what the ring handshake authenticates with: hand it only to
the Communicator.
"""
from __future__ import annotations

import logging
import queue
import random
import threading
import time
from typing import Optional, Sequence

import grpc

from rendezvous.wire import messages as wire
from rendezvous.common.channel import RendezvousCallAbandoned, RendezvousRPCError, channel_options, open_channel
from rendezvous.wire.membership import Blame, JobSpec, StragglerReport
from rendezvous.client.watch_events import Abort, Ended, Event, Finished, Pending, Standby, WorldInfo
from rendezvous.wire.messages import pb, pb_grpc

log = logging.getLogger("rendezvous.client")

# Codes after which trying again (elsewhere, a bit later) can succeed. Not INTERNAL/UNKNOWN: those
# are server bugs, and repeating the request would repeat them.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED)
_MIN_RING_SECRET = 16   # bytes; a server that sends less is not one this client can trust


def _world(w: pb.World) -> WorldInfo:
    peers = tuple(wire.member_from_pb(m) for m in w.peers)
    return WorldInfo(w.world_version, peers, w.rank, w.size, w.local_rank, w.local_size, w.cross_rank,
                     w.cross_size, bytes(w.digest), w.num_hosts, w.host_index, w.largest_host, w.prev_leader,
                     w.next_leader)


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
        self.job_spec = JobSpec()                     # the job's limits, from the Join answer
        self.spares = 0                               # workers that could take this one's place, from
                                                      # the last ReportProgress answer
        self.world: Optional[WorldInfo] = None        # the latest world received
        self._closed = threading.Event()
        self._watch_thread: Optional[threading.Thread] = None
        self._watch_call = None
        # Guards what a join changes: the rendezvous session number and id, event queue pushes, the watching flag.
        self._join_lock = threading.Condition()
        self._gen = 0                       # session number: bumped by every join()
        self._watching = False              # a watch thread runs (or is about to) for this client
        self._commit_step = -1           # resent on every (re)attach: the server keeps it soft
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
              attempt_s: Optional[float] = None, done_if_retried=(), again_if_retried=(),
              give_up: Optional[threading.Event] = None):
        """Unary call with failover across addresses and backoff, until `timeout_s` runs out, or
        until `give_up` is set: then, after a failed attempt, it raises RendezvousCallAbandoned
        (an attempt under way is not cut short: its answer may hold what the caller must undo).

        `done_if_retried`: status codes that, on a retry after an attempt whose outcome is unknown
        (DEADLINE_EXCEEDED, CANCELLED), mean the first attempt took effect (returns None then).
        `again_if_retried`: codes that, after such an attempt, are retried with backoff (the first
        attempt's effect clears by itself).
        """
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.rpc_timeout_s)
        attempt_s = attempt_s or self.rpc_timeout_s
        backoff, tried, last, unsure = 0.02, 0, None, False
        while True:
            if tried and give_up is not None and give_up.is_set():
                raise RendezvousCallAbandoned(
                    f"{method} for job {self.job_id} worker {self.worker_id}: given up after "
                    f"{tried} attempt(s) over {self.addresses}; last: {last}", grpc.StatusCode.CANCELLED)
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
                pause = backoff * (0.5 + random.random())
                if give_up is not None:
                    give_up.wait(pause)
                else:
                    time.sleep(pause)
                backoff = min(backoff * 2, self.backoff_max_s)

    # --------------------------------------------------------------------------------- API
    def join(self, commit_step: int = -1, timeout_s: float = 30.0,
             give_up: Optional[threading.Event] = None) -> str:
        """Join the job (creating it with `spec` if new) and start following it; returns the session.
        Once `give_up` is set, a failed attempt ends it with RendezvousCallAbandoned.

        Joining again (e.g. after an `Ended` event) replaces the previous session: the event queue is
        emptied and nothing from the old session is delivered any more. The previous session id is
        sent along: the server lets a worker id that is still registered join again only with it.
        """
        with self._join_lock:
            self._gen += 1
            old_sid, self.session_id = self.session_id, None   # the watch thread pauses meanwhile
            self._commit_step = max(self._commit_step, commit_step)
        try:
            # A Join whose first attempt timed out may have registered a session we never learnt:
            # the retry is then refused ALREADY_EXISTS until that session, never watched, is
            # evicted (the server's heartbeat timeout), so keep retrying within the deadline.
            resp = self._call("Join", pb.JoinRequest(
                job_id=self.job_id, worker_id=self.worker_id, host=self.host,
                ring_address=self.ring_address, commit_step=commit_step,
                spec=wire.spec_pb(self.spec), session_id=old_sid or "",
                spec_if_new=wire.spec_pb(self.spec_if_new) if self.spec_if_new else None),
                timeout_s,
                again_if_retried=(grpc.StatusCode.ALREADY_EXISTS,), give_up=give_up)
            if len(resp.ring_secret) < _MIN_RING_SECRET:
                raise RendezvousRPCError(f"Join for job {self.job_id} worker {self.worker_id}: the "
                                         f"server sent no ring secret ({len(resp.ring_secret)} "
                                         f"bytes); it is too old for this client")
        except BaseException:
            with self._join_lock:
                if self.session_id is None:
                    self.session_id = old_sid
                self._join_lock.notify_all()
            raise
        with self._join_lock:
            self.session_id = resp.session_id
            self.ring_secret = resp.ring_secret
            self.job_spec = wire.spec_from_pb(resp.spec)
            self._drain_queue()
            self._last_world_key = self._last_abort = self._last = None
            self.world = None
            start = not self._watching
            self._watching = True
            self._join_lock.notify_all()
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
            if isinstance(ev, WorldInfo) and ev.world_version >= min_version:
                return ev
            if isinstance(ev, Finished):
                raise RendezvousRPCError(f"job {self.job_id} finished: {ev.reason}",
                                         finished=ev.succeeded)
            if isinstance(ev, Ended):
                raise RendezvousRPCError(f"job {self.job_id} worker {self.worker_id}: {ev.reason}",
                                         finished=ev.finished)

    def report_progress(self, commit_step: int = -1, timeout_s: float = 1.0,
                        straggler: Optional[StragglerReport] = None, stepped_world: int = 0, step: int = -1) -> int:
        """Report the step of the last commit (-1: unchanged), this worker's pace (``straggler``),
        the newest world it completed a training step in and the training step its last commit
        holds (``step``, -1: unknown); returns the server's current world version. ``spares``
        keeps what the answer says of the workers that could take this one's place.

        Short default deadline: callers send it from their event loop, which must not stall for long
        during a server outage (the step is resent on the next call and on reattach anyway).
        """
        if commit_step > self._commit_step:
            self._commit_step = commit_step
        resp = self._call("ReportProgress", pb.ReportProgressRequest(
            session_id=self._sid(), commit_step=commit_step, straggler=wire.straggler_pb(straggler),
            stepped_world=stepped_world, step=step),
            timeout_s)
        self.spares = resp.spares
        return resp.world_version

    def report_failure(self, suspect_worker_id: str, world_version: int, reason: str = "",
                       unusable_address: bool = False, timed_out: bool = False,
                       blame: Blame = Blame.NONE, suspect_rank: Optional[int] = None) -> bool:
        """Tell the server a peer broke, or accuse it (``blame``); returns True if the server evicted
        it. The suspect is ``suspect_worker_id``, or (empty) the member of rank ``suspect_rank`` in
        world ``world_version``: a worker's view names only its rings' neighbours. ``unusable_address`` (Blame UNUSABLE): its ring address leads to no member of this job,
        or what it sent cannot be received. An accusation evicts the suspect even if it is alive,
        once a majority of the world's other members made one (the server waits up to twice its
        heartbeat timeout for theirs). ``timed_out``: the collective timed out waiting on it (it
        may be alive and busy)."""
        if unusable_address and blame is Blame.NONE:
            blame = Blame.UNUSABLE
        return self._call("ReportFailure", pb.ReportFailureRequest(
            session_id=self._sid(), world_version=world_version,
            suspect_worker_id=suspect_worker_id, reason=reason, unusable_address=blame is Blame.UNUSABLE,
            timed_out=timed_out, blame=wire.blame_pb(blame), suspect_rank=suspect_rank),
            # The server may wait up to its heartbeat timeout for the suspect's stream to break.
            timeout_s=max(30.0, self.rpc_timeout_s), attempt_s=max(15.0, self.rpc_timeout_s)).evicted

    def report_success(self, world_version: Optional[int] = None, commit_step: int = 0) -> bool:
        """This worker's function returned at ``commit_step``; True when that completed the job.

        The job completes once every member of the current world reported returning in it at the
        same commit step (the last report answers True; the Watch brings everyone ``Finished``).
        The server takes it only from a member of `world_version` (default: the latest world this
        client received); a worker that never was in a world cannot end the job."""
        if world_version is None:
            world_version = self.world.world_version if self.world is not None else 0
        # Retried after an unknown outcome, FAILED_PRECONDITION means the job already finished.
        # Retried as long as a reconnect: lost to a leader change, the success would turn into
        # a job failure once the workers are gone.
        resp = self._call("ReportSuccess", pb.ReportSuccessRequest(session_id=self._sid(),
                                                                   world_version=world_version,
                                                                   commit_step=max(commit_step, 0)),
                          max(3 * self.rpc_timeout_s, self.reconnect_timeout_s),
                          done_if_retried=(grpc.StatusCode.FAILED_PRECONDITION,))
        return resp is None or bool(resp.finished)

    def leave(self, straggler: bool = False) -> None:
        """Leave cleanly (the others see a membership change, not a failure) and stop watching;
        ``straggler``: because this worker was named one (its host then cools down)."""
        try:
            # Retried after an unknown outcome, NOT_FOUND means the first attempt removed us.
            self._call("Leave", pb.LeaveRequest(session_id=self._sid(), straggler=straggler),
                       3 * self.rpc_timeout_s,
                       done_if_retried=(grpc.StatusCode.NOT_FOUND,))
        finally:
            self.close()

    def close(self) -> None:
        """Stop the watch thread and close connections (without leaving: the server evicts us)."""
        self._closed.set()
        with self._join_lock:
            self._join_lock.notify_all()
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
            with self._join_lock:
                while self.session_id is None and not self._closed.is_set():
                    self._join_lock.wait(0.5)    # a join() is replacing the session
                sid, gen = self.session_id, self._gen
            if sid is None:
                break
            address = self.addresses[self._current]
            try:
                call = self._stub(address).Watch(
                    pb.WatchRequest(session_id=sid, commit_step=self._commit_step),
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
        with self._join_lock:
            self._watching = False

    def _stop_if(self, gen: int) -> bool:
        """End the watch thread if session `gen` is still current (the next join() starts another)."""
        with self._join_lock:
            if gen != self._gen:
                return False
            self._watching = False
            return True

    def _push(self, ev: Event, gen: int) -> bool:
        """Queue `ev` if it belongs to the current session; False if the session was replaced."""
        with self._join_lock:
            if gen != self._gen:
                return False
            self._last = ev
            self._events.put(ev)
            return True

    def _answer(self, address: str, method: str, request, what: str) -> None:
        """`method` to the server at `address`, whose Watch sent the notice it answers."""
        try:
            getattr(self._stub(address), method)(request, timeout=self.rpc_timeout_s,
                                                  metadata=self._metadata)
        except grpc.RpcError as e:
            log.warning("worker %s: %s failed: %s", self.worker_id, what, e.details())

    def _on_abort(self, abort: pb.AbortVersion, address: str, gen: int) -> None:
        world_version = abort.world_version
        with self._join_lock:
            if gen != self._gen or self._last_abort == world_version:
                return
            self._last_abort = world_version
            self._last = ev = Abort(world_version, abort.reason)
            self._events.put(ev)
        # Acknowledge at once, from this thread, as a probe is answered, when asked (a small
        # world): the next world forms as soon as every live member has, instead of after the
        # server's settle window.
        if abort.acknowledge:
            self._answer(address, "AcknowledgeAbort", pb.AcknowledgeAbortRequest(
                session_id=self.session_id, world_version=world_version), "acknowledging the abort")

    def _handle(self, ev: pb.WatchEvent, address: str, gen: int) -> None:
        kind = ev.WhichOneof("event")
        if kind == "probe":
            # Answer at once, from this thread: proof that this process is alive and not wedged.
            self._answer(address, "AnswerProbe", pb.AnswerProbeRequest(
                session_id=self.session_id, nonce=ev.probe.nonce), "answering a probe")
        elif kind == "world":
            if ev.world.HasField("aborted"):   # the abort of the world before rode with it
                self._on_abort(ev.world.aborted, address, gen)
            world = _world(ev.world)
            key = (world.world_version, world.digest)
            with self._join_lock:
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
            self._on_abort(ev.abort, address, gen)
        elif kind == "standby":
            self._push(Standby(ev.standby.world_version, ev.standby.reason), gen)
        elif kind == "finished":
            self._push(Finished(ev.finished.succeeded, ev.finished.reason), gen)
