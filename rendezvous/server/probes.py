"""Failure reports, carried out: the probes, waits and replies around `verdict.judge_report`.

The rules of a report live in verdict.py, a pure function of the job's state, what this replica
sees of the suspect's stream, the report and the time. This module only gathers those facts,
carries out each verdict (probes with nonces of its own, futures, waits, evictions, protobuf
answers) and asks again after every wait.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Optional

import grpc

from rendezvous.server import decision as d
from rendezvous.server import verdict as v
from rendezvous.server.job_record import Job
from rendezvous.server.server_wire import RpcRefusal
from rendezvous.wire.membership import Blame
from rendezvous.wire.messages import blame_from_pb, pb

log = logging.getLogger("rendezvous.server.service")


class FailureReports:
    """Carries out the verdicts on the failure reports a service receives, probing suspects with
    nonces of its own.

    Like the journal it is given plain functions, not the service: `leading_since()` (monotonic:
    when this replica began leading), `require_leader()` (raises RpcRefusal UNAVAILABLE when it no
    longer leads), `evict(job, worker_id, reason, count_failure=, cause=)` (returns the change's
    seq), `send(job, worker_id, event)` (onto its Watch stream), `apply(job, event)` and
    `wait_durable(job, seq)` (the journal's), and `record(state, event, **fields)` (history.py's
    `job`: what the event log and Status show). The clock is monotonic and passed in too, so the
    plumbing is tested with fakes (tests/rendezvous/test_probes.py); the rules are verdict.py's."""

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
        report = v.Report(reporter.worker_id, request.suspect_worker_id, request.world_version,
                          request.reason, request.timed_out,
                          blame_from_pb(request.blame, request.unusable_address))
        inquiry = v.Inquiry(reattach_until=self._leading_since() + self.heartbeat_timeout_s,
                            heartbeat_timeout_s=self.heartbeat_timeout_s)
        probe: Optional[tuple[int, asyncio.Future]] = None   # (nonce, answer) once probed
        heard = self._heard(job, report)
        try:
            while True:
                suspect = report.suspect
                seen = v.SuspectStream(open=suspect in job.streams,
                                       awaited=job.liveness.awaits_watch(suspect),
                                       probe_answered=probe is not None and probe[1].done()
                                       and not probe[1].cancelled())
                inquiry, verdict = v.judge_report(job.state, seen, report, v.Heard(tuple(heard.items())), inquiry,
                                                  self._clock())
                if isinstance(verdict, v.Refuse):
                    raise RpcRefusal(grpc.StatusCode.PERMISSION_DENIED, verdict.detail)
                if isinstance(verdict, v.Dismiss):
                    return pb.ReportFailureResponse(evicted=False, detail=verdict.detail)
                if isinstance(verdict, v.Gone):
                    await self._wait_durable(job, job.seq)
                    return pb.ReportFailureResponse(evicted=True, detail=verdict.detail)
                if isinstance(verdict, v.Evict):
                    seq = self._evict(job, suspect, verdict.reason, count_failure=verdict.count_failure,
                                      cause=verdict.cause)
                    if verdict.reporter_too:
                        seq = self._evict(job, report.reporter, verdict.reason, count_failure=verdict.count_failure,
                                          cause=verdict.cause)
                    await self._wait_durable(job, seq)
                    return pb.ReportFailureResponse(evicted=True, detail=verdict.detail)
                if isinstance(verdict, v.RingBroken):
                    await self._ring_broken(job, report, verdict)
                    return pb.ReportFailureResponse(evicted=False, detail=verdict.detail)
                if isinstance(verdict, v.AwaitReattach):
                    log.info("job %s: %s reported by %s has not reattached since this replica began "
                             "leading; waiting up to %.1f s for it", job.state.job_id, suspect,
                             report.reporter, max(0.0, verdict.until - self._clock()))
                    await self._await_stream(job, suspect, verdict.until)
                elif isinstance(verdict, v.Probe):
                    self._nonce += 1
                    probe = (self._nonce, asyncio.get_running_loop().create_future())
                    job.probes[probe[0]] = (suspect, probe[1])
                    self._send(job, suspect, pb.WatchEvent(probe=pb.Probe(nonce=probe[0])))
                elif isinstance(verdict, v.AwaitProbe):
                    await self._await_probe(job, suspect, probe[1], verdict.until)
                elif isinstance(verdict, v.AwaitCorroboration):
                    await self._await_report(job, suspect, verdict.until)
                await self._require_leader()   # stepping down ends every stream: answer UNAVAILABLE
        finally:
            if probe is not None:
                job.probes.pop(probe[0], None)

    def _heard(self, job: Job, report: v.Report) -> dict[str, Blame]:
        """The reports about `report`'s suspect in its world so far, this one added: reporter ->
        blame (an accusation outweighs a failure report of the same reporter). Soft state, like a
        probe: what a new leader has not heard is reported again after the world re-forms.
        Every report that comes in wakes the reports waiting for a majority."""
        key = (report.world_version, report.suspect)
        if report.world_version == job.state.world_version and job.state.in_world(report.reporter):
            for old in [k for k in job.reports if k[0] < job.state.world_version]:
                del job.reports[old]
            heard = job.reports.setdefault(key, {})
            if heard.get(report.reporter, Blame.NONE) is Blame.NONE:
                heard[report.reporter] = report.blame
            job.reported.set()
            job.reported = asyncio.Event()
            return heard
        return {report.reporter: report.blame}

    async def _await_report(self, job: Job, worker_id: str, until: float) -> None:
        """Wait until another report comes in, `worker_id` goes away, or the monotonic time `until` passes."""
        left = until - self._clock()
        if left <= 0 or worker_id not in job.state.workers:
            return
        try:
            await asyncio.wait_for(job.reported.wait(), left)
        except asyncio.TimeoutError:
            return

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

    async def _await_probe(self, job: Job, worker_id: str, answer: asyncio.Future, until: float) -> None:
        """Wait until `answer` comes, `worker_id`'s stream ends, or the monotonic time `until` passes."""
        left = until - self._clock()
        stream = job.streams.get(worker_id)
        if left <= 0 or stream is None:
            return
        if stream.ended.is_set():   # closed by us (shutting down): do not spin
            await asyncio.sleep(min(left, 0.05))
            return
        ended = asyncio.ensure_future(stream.ended.wait())
        try:
            await asyncio.wait([answer, ended], timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()

    async def _ring_broken(self, job: Job, report: v.Report, verdict: v.RingBroken) -> None:
        # Nobody is evicted, but the reporter's ring is broken: without a new version every
        # member would wait for a world that never comes.
        job.liveness.failure_signal(self._clock(), job.state)
        seq, _ = self._apply(job, d.RingBroken(report.reporter, report.world_version, verdict.reason))
        await self._wait_durable(job, seq)
        self._record(job.state, "ring_broken", worker_id=report.suspect,
                     world_version=report.world_version, reporter=report.reporter,
                     cause=verdict.cause, detail=verdict.record_detail)
