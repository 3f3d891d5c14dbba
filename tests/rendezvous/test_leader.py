"""Leadership (rendezvous/server/leader.py) in virtual time: the key is taken when free and handed over
on resign or once the leader's claim lapses, and the replica steps down by the clock, 0.6 x TTL after
its last acknowledged refresh, whatever the refresh call is doing. No sockets; time passes only when a
test says so."""
from __future__ import annotations

import asyncio
import functools

import pytest

from rendezvous.server.leader import Leadership
from rendezvous.server.store import Fence, MemoryStore, StoreError

from .fakes import VirtualTime, settle
from .rdzv_helpers import run_async

KEY = "/t/leader/leader"
TTL = 3


class Refreshes(MemoryStore):
    """A store whose claims' refreshes answer as told: "ok", "error" (StoreError), "expired"
    (False: the claim lapsed) or "hang" (never return)."""

    def __init__(self, clock):
        super().__init__(clock)
        self.answer = "ok"
        self.calls = 0

    async def claim(self, key, value, ttl_s):
        claim = await super().claim(key, value, ttl_s)
        if claim is not None:
            claim.refresh = functools.partial(self._refresh, claim.refresh)
        return claim

    async def _refresh(self, refresh):
        self.calls += 1
        if self.answer == "error":
            raise StoreError("refresh: connection refused")
        if self.answer == "expired":
            return False
        if self.answer == "hang":
            await asyncio.Event().wait()
        return await refresh()


def replica(store, vt, lost, identity="r1|10.0.0.1:29400"):
    return Leadership(store, KEY, identity, TTL, lost.append, clock=vt.clock, sleep=vt.sleep)


def run(body):
    async def main():
        vt, lost = VirtualTime(), []
        store = Refreshes(vt.clock)   # claims lapse in virtual time too
        leader = replica(store, vt, lost)
        try:
            await body(vt, store, lost, leader)
        finally:
            leader.drop()
    run_async(main(), 10.0)


def test_a_free_key_is_taken_and_every_write_is_fenced_with_it():
    async def body(vt, store, lost, leader):
        await leader.campaign()
        assert leader.valid()
        assert (await store.get(KEY)).value == b"r1|10.0.0.1:29400"
        assert leader.fence == Fence(KEY, b"r1|10.0.0.1:29400")
        assert await leader.current_leader() == "r1|10.0.0.1:29400"
    run(body)


def test_a_second_replica_waits_for_the_key_and_takes_it_when_the_leader_resigns():
    async def body(vt, store, lost, leader):
        await leader.campaign()
        other = replica(store, vt, lost, identity="r2|10.0.0.2:29400")
        campaign = asyncio.ensure_future(other.campaign())
        await settle()
        assert not campaign.done() and not other.valid()
        await leader.resign()
        await vt.advance(other.poll_s)      # it looks again, finds the key free and claims it
        await asyncio.wait_for(campaign, 5.0)
        assert other.valid() and not leader.valid() and lost == []
        assert await other.current_leader() == "r2|10.0.0.2:29400"
        other.drop()
    run(body)


def test_a_replica_takes_the_key_within_a_poll_once_a_crashed_leaders_claim_lapses():
    async def body(vt, store, lost, leader):
        await leader.campaign()
        leader.drop()                      # crashed: no more refreshes, and no release
        other = replica(store, vt, lost, identity="r2|10.0.0.2:29400")
        campaign = asyncio.ensure_future(other.campaign())
        await vt.advance(TTL - 0.01)
        assert not campaign.done() and await other.current_leader() == "r1|10.0.0.1:29400"
        await vt.advance(other.poll_s + 0.02)
        await asyncio.wait_for(campaign, 5.0)
        assert other.valid() and await other.current_leader() == "r2|10.0.0.2:29400"
        other.drop()
    run(body)


def test_acknowledged_refreshes_keep_leadership_valid():
    async def body(vt, store, lost, leader):
        await leader.campaign()
        for _ in range(30):
            await vt.advance(TTL / 3)
            assert leader.valid()
        assert lost == [] and store.calls >= 29
    run(body)


@pytest.mark.parametrize("answer", ["error", "hang"])
def test_without_acknowledged_refreshes_it_steps_down_at_0_6_ttl_by_the_clock(answer):
    async def body(vt, store, lost, leader):
        await leader.campaign()
        store.answer = answer
        await vt.advance(0.6 * TTL - 0.01)
        assert leader.valid() and lost == []
        await vt.advance(0.02)
        assert not leader.valid()
        assert len(lost) == 1 and "no lease refresh acknowledged" in lost[0]
    run(body)


def test_an_expired_lease_is_lost_at_the_refresh_that_says_so():
    async def body(vt, store, lost, leader):
        await leader.campaign()
        store.answer = "expired"
        await vt.advance(TTL / 3)
        assert not leader.valid() and lost == ["leader lease expired"]
    run(body)


def test_resigning_or_dropping_is_not_reported_as_a_loss():
    async def body(vt, store, lost, leader):
        await leader.campaign()
        leader.drop()
        await vt.advance(10 * TTL)
        assert not leader.valid() and lost == []
    run(body)
