"""The journal (rendezvous/server/journal.py) over a store that fails on demand: a job's actions are
delivered only once its state is stored, a burst of changes is one write, a lost answer or a
refused fence is recognised. No server, sockets or waits: the backoff sleep is a fake."""
from __future__ import annotations

import grpc
import pytest

from rendezvous.server import decision as d
from rendezvous.server.journal import Journal
from rendezvous.server.server_wire import RpcRefusal
from rendezvous.server.store import Fence

from .fakes import CONFIG, FlakyStore, job_of, running, settle
from .rdzv_helpers import run_async

PREFIX = "/t/journal"
LEADER_KEY = f"{PREFIX}/leader"
ME = Fence(LEADER_KEY, b"me")


class Harness:
    def __init__(self):
        self.store = FlakyStore()
        self.leading = True
        self.delivered: list = []
        self.fenced: list = []
        self.backoffs: list = []
        self.now = 10.0
        self.journal = Journal(self.store, PREFIX, CONFIG, fence=lambda: ME,
                               is_leader=lambda: self.leading, on_fenced=self.fenced.append,
                               deliver=self.deliver, clock=lambda: self.now, sleep=self.sleep)

    def deliver(self, job, action, before):
        self.store.log.append(("deliver", type(action).__name__))
        self.delivered.append(action)

    async def sleep(self, seconds):
        self.backoffs.append(seconds)
        await settle(1)

    async def start(self, state=None):
        """The leader key held by this replica, and a stored job; returns it."""
        await self.store.put(LEADER_KEY, ME.value)
        state = state if state is not None else running()
        rev = await self.journal.create(state, 0)
        self.store.log.clear()
        self.store.puts = 0
        return job_of(state, revision=rev)

    async def stored(self, job):
        """The job's state as a new leader would load it."""
        return next((state for state, _ in await self.journal.load() if state.job_id == job.state.job_id), None)


def run(body):
    return run_async(body(Harness()), 10.0)


def test_actions_are_delivered_only_after_their_state_is_stored():
    async def body(h):
        job = await h.start()
        seq, actions = h.journal.apply(job, d.Evict("b", "stream broken"))
        assert {type(a) for a in actions} == {d.Dropped, d.AnnounceAbort}
        assert h.delivered == []                        # decided, not yet durable
        await h.journal.wait_durable(job, seq)
        assert h.store.log == [("put", h.journal.key("j")), ("deliver", "Dropped"),
                               ("deliver", "AnnounceAbort")]
        assert await h.stored(job) == job.state == job.durable_state
    run(body)


def test_a_burst_of_changes_is_one_write_of_the_latest_state():
    async def body(h):
        job = await h.start(d.new_job("j", d.JobSpec(1, 64, 30.0), 0.0))
        for i in range(20):
            seq, _ = h.journal.apply(job, d.Join(f"w{i}", "h", f"10.0.0.1:{9000 + i}"))
        await h.journal.wait_durable(job, seq)
        assert h.store.puts == 1 and len((await h.stored(job)).workers) == 20
    run(body)


def test_progress_alone_is_soft_state_and_not_written():
    async def body(h):
        job = await h.start()
        before = job.seq
        seq, actions = h.journal.apply(job, d.Progress("a", 40))
        await settle()
        assert (seq, actions) == (before, []) and h.store.puts == 0
        assert job.state.workers["a"].commit_step == 40        # kept in memory
        seq, _ = h.journal.apply(job, d.Leave("c"))
        await h.journal.wait_durable(job, seq)
        assert (await h.stored(job)).workers["a"].commit_step == 40   # rides along
    run(body)


def test_a_failed_write_is_retried_with_backoff_and_then_delivered():
    async def body(h):
        job = await h.start()
        h.store.fail_puts = 2
        seq, _ = h.journal.apply(job, d.Evict("b", "stream broken"))
        await h.journal.wait_durable(job, seq)
        assert h.store.puts == 3 and h.backoffs == [0.05, 0.1]
        assert len(h.delivered) == 2 and h.fenced == []
    run(body)


def test_a_write_that_landed_although_its_answer_was_lost_is_recognised_by_its_bytes():
    async def body(h):
        job = await h.start()
        h.store.lose_answers = 1
        seq, _ = h.journal.apply(job, d.Evict("b", "stream broken"))
        await h.journal.wait_durable(job, seq)
        assert h.fenced == [] and len(h.delivered) == 2
        assert job.revision == (await h.store.get(h.journal.key("j"))).revision
    run(body)


def test_a_write_the_fence_refuses_steps_down_and_delivers_nothing():
    async def body(h):
        job = await h.start()
        await h.store.put(LEADER_KEY, b"another replica")
        h.journal.apply(job, d.Evict("b", "stream broken"))
        await settle()
        assert len(h.fenced) == 1 and "another replica leads" in h.fenced[0]
        assert h.delivered == [] and (await h.stored(job)).world_version == 1
    run(body)


def test_without_leadership_nothing_is_written_and_waiting_callers_are_told_to_retry():
    async def body(h):
        job = await h.start()
        h.leading = False
        seq, _ = h.journal.apply(job, d.Evict("b", "stream broken"))
        with pytest.raises(RpcRefusal) as e:
            await h.journal.wait_durable(job, seq)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "leadership lost" in e.value.message
        assert h.store.puts == 0 and h.delivered == []
    run(body)


def test_a_creation_whose_answer_was_lost_returns_the_revision_it_landed_at():
    async def body(h):
        await h.store.put(LEADER_KEY, ME.value)
        h.store.lose_answers = 1
        state = running()
        rev = await h.journal.create(state, 0)
        assert rev == (await h.store.get(h.journal.key("j"))).revision
    run(body)


def test_a_creation_that_did_not_land_is_unavailable_so_the_join_is_retried():
    async def body(h):
        await h.store.put(LEADER_KEY, ME.value)
        h.store.fail_puts = 1
        with pytest.raises(RpcRefusal) as e:
            await h.journal.create(running(), 0)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert await h.store.get(h.journal.key("j")) is None
    run(body)


def test_a_job_is_removed_only_at_the_revision_this_replica_last_wrote():
    async def body(h):
        job = await h.start()
        theirs = await h.store.put(h.journal.key("j"), b"written by another replica")
        assert await h.journal.delete(job) is False
        assert (await h.store.get(h.journal.key("j"))).revision == theirs
        job.revision = theirs
        assert await h.journal.delete(job) is True
        assert await h.store.get(h.journal.key("j")) is None
    run(body)


def test_load_returns_every_stored_job_with_its_revision():
    async def body(h):
        job = await h.start()
        assert await h.journal.load() == [(job.state, job.revision)]
    run(body)
