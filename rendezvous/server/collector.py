"""Keeps Python's cyclic garbage collector from stopping the server for seconds while it holds a large job.

A full collection walks every object the collector tracks, holding the GIL throughout. A job of
16,384 workers keeps about 1.6 million of them (worker records, world members, each Watch's
stream, task and gRPC call), and on the benchmark machine each full collection took 1.0-1.5 s,
one every few seconds while worlds changed. Nothing ran meanwhile: not the event loop, not the
leader's lease refresh (which must be acknowledged within 0.6 x the lease TTL, leader.py), so the
leader stepped down in the middle of a re-form.

So while the server holds more than `LARGE_WORKERS` workers, every few seconds the young
generations are collected and whatever survived is frozen (`gc.freeze`): the collector no longer
walks it, so a full collection costs what changed since, not the whole heap. Frozen objects are
still freed by reference counting, as nearly all of the server's are (records are replaced, not
linked in cycles); only cyclic garbage among them waits. It is taken once the server no longer
holds a large job: then everything is unfrozen and the next full collection, of a small heap,
finds it.
"""
from __future__ import annotations

import asyncio
import gc
import logging
from typing import Callable, Optional

log = logging.getLogger("rendezvous.server.collector")

LARGE_WORKERS = 1024      # below this a full collection of the whole heap takes < ~0.1 s
FREEZE_EVERY_S = 2.0


class Collector:
    """Freezes the survivors while `workers()` (the workers of every job held) is large.

    `freeze`, `unfreeze` and `collect_young` default to the gc module's; tests pass fakes."""

    def __init__(self, workers: Callable[[], int], *, large: int = LARGE_WORKERS,
                 freeze: Callable[[], None] = gc.freeze, unfreeze: Callable[[], None] = gc.unfreeze,
                 collect_young: Callable[[], object] = lambda: gc.collect(1)):
        self._workers = workers
        self.large = large
        self._freeze, self._unfreeze, self._collect_young = freeze, unfreeze, collect_young
        self.frozen = False
        self._task: Optional[asyncio.Task] = None

    def tend(self) -> None:
        """One step of the policy: freeze the survivors of a large server, unfreeze a small one."""
        if self._workers() > self.large:
            # Young cyclic garbage first, so none of it is frozen.
            self._collect_young()
            self._freeze()
            if not self.frozen:
                log.info("more than %d workers held: objects that survive are frozen, out of the "
                         "cyclic collector's sight", self.large)
            self.frozen = True
        elif self.frozen:
            self.release()

    def release(self) -> None:
        """Unfreeze everything: the next full collection walks (and frees) it again."""
        if self.frozen:
            self._unfreeze()
            self.frozen = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FREEZE_EVERY_S)
            self.tend()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.release()
