"""Fakes for the unit tests of the server's helpers: virtual time, a store that fails on demand, and
jobs in a given state. No sockets, threads or real waits: time passes only when a test says so."""
from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Optional

from rendezvous.server import decision as d
from rendezvous.server.job_record import Job
from rendezvous.server.liveness import Liveness
from rendezvous.server.store import MemoryStore, StoreError

CONFIG = d.DecisionConfig(settle_s=0.2, settle_max_s=2.0, blacklist_after=2, cooldown_min_s=10.0,
                          cooldown_max_s=35.0)
HEARTBEAT_TIMEOUT_S = 2.0


async def settle(rounds: int = 50) -> None:
    """Let every task that can run do so until it waits again (the fakes answer at once)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class VirtualTime:
    """A monotonic clock and a sleep that only move when `advance` is called."""

    def __init__(self, start: float = 1000.0):
        self.now = start
        self._sleepers: list = []
        self._seq = itertools.count()

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + max(0.0, seconds), next(self._seq), fut))
        await fut

    async def advance(self, seconds: float) -> None:
        """Let `seconds` pass: each sleeper wakes at its time, in order, and runs until it waits."""
        until = self.now + seconds
        await settle()
        while self._sleepers and self._sleepers[0][0] <= until:
            wake, _, fut = heapq.heappop(self._sleepers)
            self.now = max(self.now, wake)
            if not fut.done():
                fut.set_result(None)
            await settle()
        self.now = until


class FlakyStore(MemoryStore):
    """A MemoryStore whose next puts fail on demand: `fail_puts` fail without writing,
    `lose_answers` write and then fail (the answer is lost: the caller cannot know it landed).
    `log` records each write that landed, as ("put", key)."""

    def __init__(self):
        super().__init__()
        self.puts = 0
        self.fail_puts = 0
        self.lose_answers = 0
        self.log: list = []

    async def put(self, key, value, *, expected_revision=None, fence=None):
        self.puts += 1
        if self.fail_puts:
            self.fail_puts -= 1
            raise StoreError(f"put {key}: connection reset")
        rev = await super().put(key, value, expected_revision=expected_revision, fence=fence)
        if rev is not None:
            self.log.append(("put", key))
        if self.lose_answers:
            self.lose_answers -= 1
            raise StoreError(f"put {key}: deadline exceeded")
        return rev

    async def commit(self, puts, deletes=(), *, expected={}, fence=None, delete_prefixes=()):  # noqa: B006
        """Fails like put (a transaction with puts counts as one); logs each key it put."""
        if not puts:
            return await super().commit(puts, deletes, expected=expected, fence=fence,
                                        delete_prefixes=delete_prefixes)
        self.puts += 1
        if self.fail_puts:
            self.fail_puts -= 1
            raise StoreError("commit: connection reset")
        rev = await super().commit(puts, deletes, expected=expected, fence=fence, delete_prefixes=delete_prefixes)
        if rev is not None:
            self.log += [("put", k) for k in sorted(puts)]
        if self.lose_answers:
            self.lose_answers -= 1
            raise StoreError("commit: deadline exceeded")
        return rev


def running(workers=("a", "b", "c"), min_np=2, max_np=4, now: float = 0.0) -> d.JobState:
    """A job whose first world holds `workers` (each on a host of its own), decided at `now`."""
    state = d.new_job("j", d.JobSpec(min_np, max_np, 30.0), now)
    for i, w in enumerate(workers):
        state, _ = d.decide(state, d.Join(w, f"h{i}", f"10.0.0.{i + 1}:9000", session_hash=f"h-{w}"),
                            now, CONFIG)
    state, actions = d.decide(state, d.Tick(), now + 1.0, CONFIG)
    assert any(isinstance(a, d.AnnounceWorld) for a in actions)
    return state


def job_of(state: d.JobState, liveness: Optional[Liveness] = None, revision: int = 1) -> Job:
    return Job(state=state, revision=revision, durable_state=state,
               liveness=liveness if liveness is not None else Liveness(HEARTBEAT_TIMEOUT_S))
