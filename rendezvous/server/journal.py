"""Group commit of job states: a job's new state is in the store before anyone hears of its actions.

Every change goes through `apply`: the decision's new state replaces the in-memory one, and its actions
wait in the job's outbox. One flush per job runs at a time and writes what changed since the last
write (job_keys.py: the job's head, compare-and-swap on the revision last written and fenced by
leadership, with the changed workers' keys), so a burst of 1,024 joins is a handful of writes
and a failure in a job of 16,384 writes a few keys; once a write lands, the actions it covers are
delivered. Because every announced world is
durable before anyone sees it, a restarted server or a new leader reloads the same worlds and changes
nothing. Committed steps (Progress) are soft state: they change the in-memory state and ride along
with the next real change that is written.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Optional

import grpc

from rendezvous.server import decision as d
from rendezvous.server import job_keys
from rendezvous.server.job_record import Job
from rendezvous.server.store import Fence, Store, StoreError
from rendezvous.server.server_wire import RpcRefusal

log = logging.getLogger("rendezvous.server.service")

DURABLE_TIMEOUT_S = 10.0      # a change the store has not acknowledged by then fails its RPC


class Journal:
    """The jobs' states in the store under `prefix`/jobs/, written only while `is_leader()`, each
    write fenced by `fence()` (the leader's key as it is now).

    `deliver(job, action, before)` is called for each action once its state is durable (`before`:
    the job's state the decision started from, so its world and version);
    `on_fenced(why)` when a fenced write is refused (another replica leads or wrote the job).
    `clock` (wall time, what the decision is fed) and `sleep` (the backoff between failed writes)
    are passed in so the journal is tested with fakes (tests/rendezvous/test_journal.py)."""

    def __init__(self, store: Store, prefix: str, config: d.DecisionConfig, *,
                 fence: Callable[[], Fence], is_leader: Callable[[], bool],
                 on_fenced: Callable[[str], None],
                 deliver: Callable[[Job, d.Action, d.JobState], None],
                 clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.store = store
        self.prefix = prefix
        self.config = config
        self._fence = fence
        self._is_leader = is_leader
        self._on_fenced = on_fenced
        self._deliver = deliver
        self._clock = clock
        self._sleep = sleep
        self._stored: dict[str, job_keys.StoredJob] = {}   # job id -> what the store holds of it

    def key(self, job_id: str) -> str:
        """The job's head key: its revision is the job's (job_keys.py)."""
        return job_keys.head_key(self.prefix, job_id)

    async def load(self) -> list[tuple[d.JobState, int]]:
        """Every stored job with its revision; raises StoreError."""
        items = await self.store.get_prefix(job_keys.root(self.prefix))
        jobs = job_keys.parse(self.prefix, items)
        self._stored = {state.job_id: stored for state, stored in jobs}
        return [(state, stored.revision or stored.legacy_revision) for state, stored in jobs]

    def _stored_of(self, job: Job) -> job_keys.StoredJob:
        stored = self._stored.setdefault(job.state.job_id, job_keys.StoredJob())
        if stored.legacy_key:
            stored.legacy_revision = job.revision
        else:
            stored.revision = job.revision
        return stored

    async def _commit_staged(self, plan: job_keys.Plan) -> bool:
        """The plan's transactions before the head's (puts no reader sees yet). False: fenced."""
        for batch in plan.staged:
            if await self.store.commit(batch, fence=self._fence()) is None:
                return False
        return True

    async def _clean_up(self, plan: job_keys.Plan) -> None:
        """Deletes what the head just committed made unread; what fails is deleted by the next write."""
        after = plan.after
        for i in range(0, len(after), job_keys.WRITE_OPS):
            batch = after[i:i + job_keys.WRITE_OPS]
            try:
                if await self.store.commit({}, batch, fence=self._fence()) is None:
                    plan.stored.garbage += after[i:]
                    return
            except StoreError:
                plan.stored.garbage += after[i:]
                return

    def apply(self, job: Job, event: d.Event) -> tuple[int, list]:
        """Decide; queue the actions for after the next durable write. Returns (seq, actions)."""
        now = self._clock()
        before = job.state
        state, actions = d.decide(job.state, event, now, self.config)
        if state is not job.state:
            job.state = state
            if isinstance(event, (d.Progress, d.AbortAck)) and not actions:
                # Soft state: not worth a write of the whole job per report. It is stored with the
                # next real change, and resent by the client on reattach / next heartbeat. (An
                # abort's acknowledgements lost to a failover cost the settle window, nothing more.)
                return job.seq, actions
            job.seq += 1
            for a in actions:
                if not isinstance(a, d.Rejected):
                    job.outbox.append((job.seq, a, before))
            self._kick(job)
        job.wake.set()
        return job.seq, actions

    def _kick(self, job: Job) -> None:
        if not job.flushing:
            job.flushing = True
            asyncio.get_running_loop().create_task(self._flush(job))

    async def _flush(self, job: Job) -> None:
        """Write the latest state, then deliver every action that state covers; repeat until caught up."""
        key = self.key(job.state.job_id)
        backoff = 0.05
        unsure: dict[bytes, job_keys.Plan] = {}   # head writes whose outcome we did not learn
        try:
            while job.durable_seq < job.seq and self._is_leader():
                seq, state = job.seq, job.state
                plan = job_keys.plan(self.prefix, state, self._stored_of(job))
                try:
                    rev = None
                    if await self._commit_staged(plan):
                        rev = await self.store.commit(plan.puts, plan.deletes, expected=plan.expected,
                                                      fence=self._fence())
                    if rev is None and unsure:
                        # CAS refused after an ambiguous write: if that write did land, the head
                        # holds exactly its bytes and we are still the one writing this job.
                        cur = await self.store.get(key)
                        if cur is not None and cur.value in unsure:
                            log.info("job %s: an earlier write did land (revision %d); continuing",
                                     job.state.job_id, cur.revision)
                            landed = unsure[cur.value]
                            landed.stored.revision = cur.revision
                            self._stored[job.state.job_id] = landed.stored
                            job.revision = cur.revision
                            unsure = {}
                            await self._clean_up(landed)
                            continue
                except StoreError as e:
                    log.warning("job %s: writing state failed: %s; retrying", job.state.job_id, e)
                    unsure[plan.head] = plan
                    await self._sleep(backoff)
                    backoff = min(backoff * 2, 1.0)
                    continue
                if rev is None:
                    self._on_fenced(f"fenced write of job {job.state.job_id} refused: "
                                    f"another replica leads or wrote it")
                    return
                unsure = {}
                plan.stored.revision = rev
                self._stored[job.state.job_id] = plan.stored
                job.revision = rev
                job.durable_seq = seq
                job.durable_state = state
                ready = [x for x in job.outbox if x[0] <= seq]
                job.outbox = [x for x in job.outbox if x[0] > seq]
                for _, action, before in ready:
                    self._deliver(job, action, before)
                async with job.durable:
                    job.durable.notify_all()
                await self._clean_up(plan)
        finally:
            job.flushing = False

    async def wait_durable(self, job: Job, seq: int) -> None:
        """Return once change `seq` of `job` is stored; RpcRefusal UNAVAILABLE if the store does not
        acknowledge it in time or leadership is lost first."""
        try:
            async with job.durable:
                await asyncio.wait_for(job.durable.wait_for(lambda: job.durable_seq >= seq
                                                            or not self._is_leader()),
                                       DURABLE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RpcRefusal(grpc.StatusCode.UNAVAILABLE,
                              f"job {job.state.job_id}: the store did not acknowledge the change "
                              f"within {DURABLE_TIMEOUT_S:g} s") from None
        if job.durable_seq < seq:
            raise RpcRefusal(grpc.StatusCode.UNAVAILABLE, "leadership lost before the change was "
                                                           "stored; retry against the new leader")

    async def create(self, state: d.JobState, expected_revision: int) -> Optional[int]:
        """Write a new job, or a new run over the finished one stored at `expected_revision`.
        Returns its revision; None when the fenced write was refused; RpcRefusal UNAVAILABLE when
        the store failed and the write did not land."""
        key = self.key(state.job_id)
        try:
            if expected_revision and not await self._remove(state.job_id, expected_revision):
                return None
            plan = job_keys.first_write(self.prefix, state)
            if not await self._commit_staged(plan):
                return None
            rev = await self.store.commit(plan.puts, plan.deletes, expected=plan.expected, fence=self._fence())
        except StoreError as e:
            # Ambiguous: it may have landed. Re-read once; otherwise the client retries the Join.
            try:
                cur = await self.store.get(key)
            except StoreError:
                cur = None
            if cur is None or cur.value != plan.head:
                raise RpcRefusal(grpc.StatusCode.UNAVAILABLE, f"job {state.job_id}: cannot create "
                                                               f"it in the store ({e}); retry") from None
            rev = cur.revision
        if rev is not None:
            plan.stored.revision = rev
            self._stored[state.job_id] = plan.stored
        return rev

    async def _remove(self, job_id: str, revision: int) -> bool:
        """Deletes every key of the job if its head (or its value of an earlier layout) is still at
        `revision`. False when refused."""
        stored = self._stored.get(job_id, job_keys.StoredJob())
        if stored.legacy_key:
            expected, deletes = {stored.legacy_key: revision}, [stored.legacy_key]
        else:
            expected, deletes = {self.key(job_id): revision}, []
        ok = await self.store.commit({}, deletes, expected=expected, fence=self._fence(),
                                     delete_prefixes=[job_keys.job_prefix(self.prefix, job_id)])
        if ok is not None:
            self._stored.pop(job_id, None)
        return ok is not None

    async def delete(self, job: Job) -> bool:
        """Remove the job once its pending changes are stored, conditional on the revision last
        written (so no change slips in between). False when refused because someone else wrote it;
        raises StoreError/RpcRefusal when the store failed."""
        if job.seq > job.durable_seq:
            await self.wait_durable(job, job.seq)
        job_id = job.state.job_id
        ok = await self._remove(job_id, job.revision)
        # Refused: unless an earlier attempt (its answer lost) deleted it, someone else wrote.
        return ok or await self.store.get(self.key(job_id)) is None
