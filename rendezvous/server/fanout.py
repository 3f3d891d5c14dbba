"""How the leader puts what it sends on a job's Watch streams: each stream's items in order, aborts paced.

An abort of a world of N puts a notice on N stream queues, and each put wakes that stream's
handler. Put all at once, the next turn of the event loop runs N handlers (at 16,384, ~0.4 s) and
then their writes' completions before anything else: the journal's next write, the evictions of
workers that died with the first, the settle window's tick all waited behind them, so a re-form
paid for every abort's write before its world could even be decided. `FanOut` paces an abort,
CHUNK streams per turn of the loop, and every send of a job goes through it, so that each stream
still gets its items in the order they were sent.

A world announced while the abort is still on its way is sent at once, and the streams the abort
has not reached yet get one World carrying it (`merged`): one write instead of two (the worker is
told both, in that order), where a worker killed with the first one would otherwise cost every
survivor a second write. Once the next world is decided, the abort's pacing stops until that world
is stored and announced (at most HOLD_MAX_S): what is left of it rides with the world. At 16,384
workers the pacing still had ~8,000 streams to go when the world was decided, and their writes
held up the world's own write to the store and its announcement.
"""
from __future__ import annotations

import asyncio
import collections
from typing import Callable, Iterable, Optional

from rendezvous.server.world_views import PendingView
from rendezvous.wire.messages import pb

CHUNK = 512   # streams an abort is put on per turn of the event loop (~15 ms of handlers)
# How long an abort waits for the world decided after it to be announced (its store write, retried
# while the store fails) before the rest of it is paced out on its own.
HOLD_MAX_S = 1.0
HOLD_POLL_S = 0.02


class AbortNotice:
    """The abort of a world (an AbortVersion), serialized once for every member's stream."""

    __slots__ = ("message", "_serialized")

    def __init__(self, message: pb.AbortVersion):
        self.message = message
        self._serialized = pb.WatchEvent(abort=message).SerializeToString()

    def serialized(self) -> bytes:
        return self._serialized


class FanOut:
    """Puts (worker id, item) pairs on the queues of `streams` (worker id -> job_record.Stream: the
    job's open streams): a paced send CHUNK streams per turn of the loop, any other at once, after
    what still waits for the same stream. An item waits for the stream that was open when it was
    sent: if that stream closed or was replaced meanwhile (a reattach, whose snapshot says what is
    current), the item is dropped rather than handed to another. `decided()` is the version of the
    job's newest world decided (announced or not): an abort of an older one is held for it."""

    def __init__(self, streams: dict, decided: Callable[[], int] = lambda: 0):
        self._streams = streams
        self._decided = decided
        self._announced = 0   # the newest world whose views were sent
        # worker id -> (the stream its items were sent to, [items]), oldest first
        self._backlog: collections.OrderedDict = collections.OrderedDict()
        self._task: Optional[asyncio.Task] = None

    def send(self, items: Iterable[tuple[str, object]], paced: bool = False) -> None:
        streams, backlog = self._streams, self._backlog
        if not paced:
            for worker_id, item in items:
                if isinstance(item, PendingView) and item.views.world_version > self._announced:
                    self._announced = item.views.world_version
                stream = streams.get(worker_id)
                waiting = backlog.pop(worker_id, None)
                if stream is None:
                    continue
                if waiting is not None and waiting[0] is stream:
                    waiting[1].append(item)
                    self._put(worker_id, stream, merged(waiting[1]))
                else:
                    self._put(worker_id, stream, (item,))
            return
        for worker_id, item in items:
            stream = streams.get(worker_id)
            if stream is None:
                continue
            waiting = backlog.get(worker_id)
            if waiting is not None and waiting[0] is stream:
                waiting[1].append(item)
            else:
                backlog[worker_id] = (stream, [item])
        if self._task is None or self._task.done():   # nothing was waiting: a chunk at once
            self._put_chunk()
            if backlog:
                self._task = asyncio.get_running_loop().create_task(self._drain())

    def close(self) -> None:
        """Drops what waits (the streams are being ended: leadership lost, the server stopping)."""
        self._backlog.clear()
        if self._task is not None:
            self._task.cancel()

    def _put(self, worker_id: str, stream, items) -> None:
        if self._streams.get(worker_id) is stream:
            for item in items:
                stream.queue.put_nowait(item)

    def _put_chunk(self) -> None:
        for _ in range(min(CHUNK, len(self._backlog))):
            worker_id, (stream, items) = self._backlog.popitem(last=False)
            self._put(worker_id, stream, items)

    def _held(self) -> Optional[int]:
        """The world version of the oldest waiting item, if it is an abort of a world whose successor
        is decided, not yet sent (held for it); None otherwise."""
        _, items = next(iter(self._backlog.values()))
        version = items[0].message.world_version if isinstance(items[0], AbortNotice) else None
        return version if version is not None and self._announced <= version < self._decided() else None

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        hold = None   # (the version held, since)
        while self._backlog:
            await asyncio.sleep(0)   # one turn of the loop: the handlers woken, journal, timers
            version = self._held() if self._backlog else None
            if version is not None:
                if hold is None or hold[0] != version:   # each world's abort gets its own HOLD_MAX_S
                    hold = (version, loop.time())
                if loop.time() - hold[1] < HOLD_MAX_S:
                    await asyncio.sleep(HOLD_POLL_S)
                    continue
            self._put_chunk()


def merged(items: list) -> list:
    """`items` (one stream's, in order) with each abort notice that is followed at once by the view
    of a newer world folded into that view: what it writes, one World carrying the abort."""
    out: list = []
    for item in items:
        if (isinstance(item, PendingView) and out and isinstance(out[-1], AbortNotice)
                and item.views.world_version > out[-1].message.world_version):
            item = PendingView(item.views, item.member, aborted=out.pop().message)
        out.append(item)
    return out
