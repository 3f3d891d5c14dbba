"""Leader election among rendezvous replicas through the store: one leased key, held by the leader.

The leader writes every job state fenced by this key (`Fence(key, identity)`), so a replica that lost its
lease (paused, partitioned) can never overwrite what the new leader wrote. Only the leader's lease is
kept alive against etcd — not one lease per worker — so the store's load does not grow with the job.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Optional

from .store import Fence, Store, StoreError

log = logging.getLogger("rendezvous.leader")


class Leadership:
    def __init__(self, store: Store, key: str, identity: str, ttl_s: int,
                 on_lost: Callable[[str], Awaitable[None]]):
        self.store = store
        self.key = key
        self.identity = identity.encode()
        self.ttl_s = ttl_s
        self._on_lost = on_lost
        self._lease: Optional[int] = None
        self._keepalive: Optional[asyncio.Task] = None

    @property
    def fence(self) -> Fence:
        return Fence(self.key, self.identity)

    @property
    def held(self) -> bool:
        return self._lease is not None

    async def current_leader(self) -> Optional[str]:
        got = await self.store.get(self.key)
        return got.value.decode(errors="replace") if got else None

    async def campaign(self) -> None:
        """Return once this replica holds the leader key (retries store errors with backoff)."""
        backoff = 0.1
        while True:
            try:
                lease = await self.store.grant_lease(self.ttl_s)
                if await self.store.put(self.key, self.identity, expected_revision=0, lease=lease):
                    self._lease = lease
                    self._keepalive = asyncio.get_running_loop().create_task(self._keep_alive())
                    return
                await self.store.revoke_lease(lease)
                watch = await self.store.watch(self.key)
                try:
                    if await self.store.get(self.key) is not None:  # still held: wait for it to go
                        try:
                            while await watch.next(timeout=self.ttl_s) is not None:
                                pass
                        except asyncio.TimeoutError:
                            pass  # re-check: a missed event must not stall the campaign
                finally:
                    watch.close()
                backoff = 0.1
            except StoreError as e:
                log.warning("leader campaign: %s; retrying in %.1f s", e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _keep_alive(self) -> None:
        last_ok = time.monotonic()
        while self._lease is not None:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                if await self.store.refresh_lease(self._lease):
                    last_ok = time.monotonic()
                    continue
                reason = "leader lease expired"
            except StoreError as e:
                # Unsure whether etcd still counts the lease: stop acting as leader before it could
                # have expired, so two replicas never both believe they lead.
                if time.monotonic() - last_ok < self.ttl_s * 0.6:
                    continue
                reason = f"cannot refresh leader lease: {e}"
            self._lease = None
            await self._on_lost(reason)
            return

    async def resign(self) -> None:
        """Give the key up now (graceful shutdown) so another replica takes over without waiting."""
        lease, self._lease = self._lease, None
        if self._keepalive is not None:
            self._keepalive.cancel()
        if lease is not None:
            try:
                await self.store.revoke_lease(lease)
            except StoreError as e:
                log.warning("resign: %s (the lease will expire by itself)", e)

    def drop(self) -> None:
        """Forget leadership locally (after a fenced write was refused)."""
        self._lease = None
        if self._keepalive is not None:
            self._keepalive.cancel()
