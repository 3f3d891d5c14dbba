"""Failure reports: a peer's ReportFailure is evidence, not a verdict; this is how it is judged.

* It evicts at once only a suspect without a stream that had one under this leader. Right after a
  leader change or restart nobody has a stream yet, so a suspect that has not reattached gets until
  the heartbeat timeout since leadership began to do so.
* A suspect with a stream is probed (a Probe event, answered by its client with a Heartbeat). If its
  (Python) client does not answer, e.g. because training code holds the GIL, keepalive is trusted:
  the report waits up to the heartbeat timeout for the stream to break, and evicts nobody while the
  connection stays alive. The reporter's ring is broken all the same, so the world is aborted and
  announced again (RingBroken) instead of every member waiting for an eviction.
* Only a report that does evict counts against the suspect's host, and not when the suspect never
  reattached after a leader change (the server's doing as much as the host's).
* Only members of the world a report names may report; the reason they give is shown escaped and
  shortened (peer_text.shown).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import grpc

from rendezvous.server import decision as d
from rendezvous.common import peer_text
from rendezvous.server.job_record import Job
from rendezvous.server.server_wire import RpcRefusal
from rendezvous.wire.messages import pb

log = logging.getLogger("rendezvous.server.service")


class FailureReports:
    """Judges the failure reports a service receives, probing suspects with nonces of its own.

    Like the journal it is given plain functions, not the service: `leading_since()` (monotonic:
    when this replica began leading), `require_leader()` (raises RpcRefusal UNAVAILABLE when it no
    longer leads), `evict(job, worker_id, reason, count_failure=, cause=)` (returns the change's
    seq), `send(job, worker_id, event)` (onto its Watch stream), `apply(job, event)` and
    `wait_durable(job, seq)` (the journal's), and `record(state, event, **fields)` (history.py's
    `job`: what the event log and Status show). The clock is monotonic and passed in too, so the
    rules are tested with fakes (tests/rendezvous/test_probes.py)."""

    def __init__(self, heartbeat_timeout_s: float, *, leading_since: Callable[[], float],
                 require_leader: Callable[[], Awaitable[None]], evict: Callable[..., int],
                 send: Callable[[Job, str, object], None],
                 apply: Callable[[Job, d.Event], tuple[int, list]],
                 wait_durable: Callable[[Job, int], Awaitable[None]],
                 record: Callable[..., None], clock: Callable[[], float] = time.monotonic):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._leading_since = leading_since
        self._require_leader = require_leader
        self._evict = evict
        self._send = send
        self._apply = apply
        self._wait_durable = wait_durable
        self._record = record
        self._clock = clock
        self._nonce = int(time.time() * 1000) << 16

    async def judge(self, job: Job, reporter: d.Worker, request) -> pb.ReportFailureResponse:
        """The answer to `reporter`'s ReportFailure `request` about a member of `job`'s world."""
        state = job.state
        heartbeat_timeout_s = self.heartbeat_timeout_s
        if request.world_version != state.version:
            return pb.ReportFailureResponse(
                evicted=False, detail=f"stale report: world {request.world_version} is not the "
                                      f"current world {state.version}")
        if not state.in_world(reporter.worker_id):
            raise RpcRefusal(grpc.StatusCode.PERMISSION_DENIED,
                              f"job {state.job_id}: worker {reporter.worker_id} is not a member of "
                              f"world {state.version}; only its members report its failures")
        suspect = request.suspect_worker_id
        if suspect not in state.workers or not state.in_world(suspect):
            return pb.ReportFailureResponse(evicted=False, detail=f"{suspect} is not a member of "
                                                                  f"world {state.version} (already "
                                                                  f"evicted or left)")
        target = state.workers[suspect]
        why = f"reported by {reporter.worker_id}: {peer_text.shown(request.reason) or 'unreachable'}"

        def same_suspect() -> bool:
            cur = job.state.workers.get(suspect)
            return cur is not None and cur.join_seq == target.join_seq

        if suspect not in job.streams and job.liveness.awaits_watch(suspect):
            # It has not reattached since this replica began leading (a failover or restart: no
            # worker has its stream back yet). Its silence says nothing yet: give it the heartbeat
            # timeout since leadership began.
            until = self._leading_since() + heartbeat_timeout_s
            log.info("job %s: %s reported by %s has not reattached since this replica began leading;"
                     " waiting up to %.1f s for it", state.job_id, suspect, reporter.worker_id,
                     max(0.0, until - self._clock()))
            await self._await_stream(job, suspect, until)
            if not same_suspect():
                await self._wait_durable(job, job.seq)
                return pb.ReportFailureResponse(evicted=True, detail="suspect gone meanwhile")
        if request.unusable_address:
            # A probe answer would prove only that the suspect lives, not that its ring
            # address leads anywhere: alive or not, no ring of this job can include it.
            seq = self._evict(job, suspect, f"unusable ring address; {why}",
                              cause=d.Departure.UNUSABLE_ADDRESS)
            await self._wait_durable(job, seq)
            return pb.ReportFailureResponse(evicted=True, detail="suspect's ring address is unusable")
        if suspect not in job.streams:
            # Never reattached under this leader: the server's doing as much as the host's.
            seq = self._evict(job, suspect, f"no watch stream; {why}",
                              count_failure=not job.liveness.awaits_watch(suspect),
                              cause=d.Departure.REPORTED)
            await self._wait_durable(job, seq)
            return pb.ReportFailureResponse(evicted=True, detail="suspect had no watch stream")
        # The suspect has a stream, so keepalive vouches for it (answered by gRPC's C core, even while
        # its training code holds the GIL). Probe it, and wait up to the heartbeat timeout for either
        # a probe answer or the stream to break (a stopped/partitioned process fails keepalive).
        self._nonce += 1
        nonce = self._nonce
        fut = asyncio.get_running_loop().create_future()
        job.probes[nonce] = (suspect, fut)
        self._send(job, suspect, pb.WatchEvent(probe=pb.Probe(nonce=nonce)))
        deadline = self._clock() + heartbeat_timeout_s + 0.25
        try:
            while True:
                await self._require_leader()   # stepping down ends every stream: answer UNAVAILABLE
                if not same_suspect():
                    await self._wait_durable(job, job.seq)
                    return pb.ReportFailureResponse(evicted=True, detail="suspect's stream broke")
                stream = job.streams.get(suspect)
                if stream is None:
                    seq = self._evict(job, suspect, f"no watch stream; {why}",
                                      cause=d.Departure.REPORTED)
                    await self._wait_durable(job, seq)
                    return pb.ReportFailureResponse(evicted=True, detail="suspect lost its stream")
                left = deadline - self._clock()
                if left <= 0:
                    await self._ring_broken(job, reporter.worker_id, request, why)
                    return pb.ReportFailureResponse(
                        evicted=False, detail=f"{suspect} did not answer the probe but its "
                                              f"connection stayed alive (keepalive) for "
                                              f"{heartbeat_timeout_s:g} s; world "
                                              f"{request.world_version} re-formed")
                if stream.ended.is_set():   # closed by us (shutting down): do not spin
                    await asyncio.sleep(min(left, 0.05))
                    continue
                ended = asyncio.ensure_future(stream.ended.wait())
                try:
                    await asyncio.wait([fut, ended], timeout=left,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    ended.cancel()
                if fut.done() and not fut.cancelled():
                    await self._ring_broken(job, reporter.worker_id, request, why)
                    return pb.ReportFailureResponse(evicted=False,
                                                    detail=f"{suspect} answered a probe; world "
                                                           f"{request.world_version} re-formed")
        finally:
            job.probes.pop(nonce, None)

    async def _await_stream(self, job: Job, worker_id: str, until: float) -> None:
        """Wait until `worker_id` has a stream, is gone, or the monotonic time `until` passes."""
        while worker_id not in job.streams and worker_id in job.state.workers:
            left = until - self._clock()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(job.attached.wait(), left)
            except asyncio.TimeoutError:
                return
            await self._require_leader()

    async def _ring_broken(self, job: Job, reporter_id: str, request, why: str) -> None:
        # Nobody is evicted, but the reporter's ring is broken: without a new version every
        # member would wait for a world that never comes.
        version, suspect = request.world_version, request.suspect_worker_id
        member = job.state.member(suspect)
        job.liveness.failure_signal(self._clock(), job.state)
        seq, _ = self._apply(job, d.RingBroken(
            reporter_id, version, f"ring of world {version} broken, every member alive ({why})"))
        await self._wait_durable(job, seq)
        who = f"rank {member.rank} ({suspect})" if member is not None else suspect
        cause = "collective timeout" if request.timed_out else "broken ring link"
        # Ids and a kind only: the reporter's own words stay in the abort notice and the log.
        self._record(job.state, "ring_broken", worker_id=suspect, world_version=version,
                     reporter=reporter_id, cause=cause.replace(" ", "_"),
                     detail=f"{cause} waiting on {who}, every member alive")
