"""Leader election among rendezvous replicas through the store: one claimed key, held by the leader.

The leader writes every job state fenced by this key (`Fence(key, identity)`), so a replica that lost its
claim (paused, partitioned) can never overwrite what the new leader wrote. Only the leader's claim (an
etcd lease) is kept alive against etcd — not one lease per worker — so the store's load does not grow
with the job. The other replicas read the key every TTL/8 and claim it once it is gone.

Stepping down is driven by a clock, not by the refresh call: a refresh that hangs (etcd connection
stalled, etcd overloaded) must not keep this replica serving while etcd expires its lease and another
replica takes over. Each refresh has a deadline below ttl/3, and leadership is valid only until the
send time of the last acknowledged refresh plus 0.6 x ttl — well before etcd (which measures the TTL
from when it received that refresh) can expire the lease. `valid()` says so at any instant, and a
watchdog calls `on_lost` when that time passes even if the refresh is still stuck.

Where the store can refresh from any thread (etcd), the refreshes run on a thread of their own,
not on the event loop: the loop may be busy for a while with a large job (deciding and announcing
a world of 16,384 took ~0.5 s on the benchmark machine), and a refresh that waited for it could
come too late for a lease of 2 s. Leadership itself is still judged on the loop, by the same clock.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Awaitable, Callable, Optional

from rendezvous.server.store import Claim, Fence, Store, StoreError

log = logging.getLogger("rendezvous.server.leader")


class Leadership:
    """This replica's claim on the leader key. `on_lost(why)` is called when it is lost other than
    by `resign()`/`drop()`. The monotonic `clock` and `sleep` are passed in so the step-down is
    tested in virtual time (tests/rendezvous/test_leader.py)."""

    def __init__(self, store: Store, key: str, identity: str, ttl_s: int,
                 on_lost: Callable[[str], None], *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self.store = store
        self.key = key
        self.identity = identity.encode()
        self.ttl_s = ttl_s
        self._on_lost = on_lost
        self._clock = clock
        self._sleep = sleep
        self._claim: Optional[Claim] = None
        self._keepalive: Optional[asyncio.Task] = None
        self._watchdog: Optional[asyncio.Task] = None
        self._valid_until = 0.0          # monotonic: leadership may be acted on until then
        self._stop_refreshing: Optional[threading.Event] = None   # the refresh thread's, if any
        self._lock = threading.Lock()    # the refresh thread's checks and writes against drop()

    @property
    def step_down_after_s(self) -> float:
        return self.ttl_s * 0.6

    def valid(self) -> bool:
        """Held, and the last acknowledged refresh is recent enough that etcd still counts it."""
        return self._claim is not None and self._clock() < self._valid_until

    @property
    def fence(self) -> Fence:
        return Fence(self.key, self.identity)

    async def current_leader(self) -> Optional[str]:
        got = await self.store.get(self.key)
        return got.value.decode(errors="replace") if got else None

    @property
    def poll_s(self) -> float:
        """How often a replica that does not lead looks whether the key is free."""
        return self.ttl_s / 8

    async def campaign(self) -> None:
        """Return once this replica holds the leader key (retries store errors with backoff)."""
        backoff = 0.1
        while True:
            try:
                sent = self._clock()
                claim = await self.store.claim(self.key, self.identity, self.ttl_s)
                if claim is not None:
                    self._claim = claim
                    self._valid_until = sent + self.step_down_after_s
                    loop = asyncio.get_running_loop()
                    refresh = claim.blocking_refresh()
                    if refresh is not None:
                        self._stop_refreshing = threading.Event()
                        threading.Thread(target=self._keep_alive_here, name="rdzv-lease",
                                         args=(claim, refresh, loop, self._stop_refreshing),
                                         daemon=True).start()
                    else:
                        self._keepalive = loop.create_task(self._keep_alive(claim))
                    self._watchdog = loop.create_task(self._watch_validity(claim))
                    return
                # Held: read (not claim) until it is gone. A read costs etcd no lease and no write.
                while await self.store.get(self.key) is not None:
                    await self._sleep(self.poll_s)
                backoff = 0.1
            except StoreError as e:
                log.warning("leader campaign: %s; retrying in %.1f s", e, backoff)
                await self._sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _keep_alive(self, claim: Claim) -> None:
        period = self.ttl_s / 3
        pause = period
        while self._claim is claim:
            await self._sleep(pause)
            sent = self._clock()
            try:
                # Deadline below ttl/3: a hung call must not delay the next attempt.
                alive = await asyncio.wait_for(claim.refresh(), period * 0.9)
            except (StoreError, asyncio.TimeoutError) as e:
                log.warning("leader lease refresh failed: %s", e or "no answer within "
                            f"{period * 0.9:.2f} s")
                # A refused call moved the store to another etcd member: try it soon, as waiting
                # a whole period could outlast the step-down time. After a timeout (a hung call
                # may still hold a thread) keep the period. The watchdog steps down if this goes on.
                pause = period if isinstance(e, asyncio.TimeoutError) else min(0.05, period)
                continue
            pause = period
            if self._claim is not claim:
                return
            if not alive:
                self._lose(claim, "leader lease expired")
                return
            self._valid_until = max(self._valid_until, sent + self.step_down_after_s)

    def _keep_alive_here(self, claim: Claim, refresh: Callable[[], bool],
                         loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        """`_keep_alive` on a thread of its own, with blocking refreshes (the store's own timeout
        bounds a hung one; the watchdog steps down meanwhile if it must)."""
        period = self.ttl_s / 3
        pause = period
        while not stop.wait(pause):
            sent = self._clock()
            try:
                alive = refresh()
            except StoreError as e:
                log.warning("leader lease refresh failed: %s", e)
                pause = min(0.05, period)   # as _keep_alive: another member may answer now
                continue
            pause = period
            with self._lock:
                if self._claim is not claim:
                    return
                if alive:
                    self._valid_until = max(self._valid_until, sent + self.step_down_after_s)
            if not alive:
                loop.call_soon_threadsafe(self._lose, claim, "leader lease expired")
                return

    async def _watch_validity(self, claim: Claim) -> None:
        while self._claim is claim:
            left = self._valid_until - self._clock()
            if left <= 0:
                self._lose(claim, f"no lease refresh acknowledged for {self.step_down_after_s:.1f} s "
                                  f"(etcd unreachable or stalled)")
                return
            await self._sleep(left + 0.005)

    def _lose(self, claim: Claim, reason: str) -> None:
        if self._claim is not claim:
            return
        self.drop()
        self._on_lost(reason)

    async def resign(self) -> None:
        """Give the key up now (graceful shutdown) so another replica takes over without waiting."""
        claim = self._claim
        self.drop()
        if claim is not None:
            try:
                await claim.release()
            except StoreError as e:
                log.warning("resign: %s (the lease will expire by itself)", e)

    def drop(self) -> None:
        """Forget leadership locally (after a fenced write was refused, or on stepping down)."""
        with self._lock:
            self._claim = None
            self._valid_until = 0.0
        if self._stop_refreshing is not None:
            self._stop_refreshing.set()
            self._stop_refreshing = None
        current = asyncio.current_task()
        for task in (self._keepalive, self._watchdog):
            if task is not None and task is not current:
                task.cancel()
