"""What the leader puts on a job's Watch streams: each stream's items in order, an abort paced a
chunk of streams per turn of the event loop, and an abort still waiting folded into the next world."""
from __future__ import annotations

import asyncio

import pytest

from rendezvous.server import fanout
from rendezvous.server.fanout import AbortNotice, FanOut, merged
from rendezvous.server.job_record import Stream
from rendezvous.server.world_views import PendingView, WorldViews
from rendezvous.wire.membership import Member
from rendezvous.wire.messages import pb


def members(n):
    return tuple(Member(f"w{i}", f"h{i // 8}", f"10.0.{i // 8}.1:{4000 + i}", i, i % 8, min(8, n - i // 8 * 8),
                        i // 8, -(-n // 8), -1) for i in range(n))


def abort(version):
    return AbortNotice(pb.AbortVersion(world_version=version, reason=f"world {version}: worker x evicted"))


WORLD2, WORLD3 = WorldViews(2, members(4)), WorldViews(3, members(4))


def view(views, rank=1):
    return PendingView(views, views.members[rank])


def shape(items):
    """Each item as ("abort", V), ("world", V, aborted V or None) or the item itself."""
    out = []
    for item in items:
        if isinstance(item, AbortNotice):
            out.append(("abort", item.message.world_version))
        elif isinstance(item, PendingView):
            out.append(("world", item.views.world_version, item.aborted.world_version if item.aborted else None))
        else:
            out.append(item)
    return out


@pytest.mark.parametrize("items, expected", [
    ([], []),
    ([abort(1)], [("abort", 1)]),
    ([view(WORLD2)], [("world", 2, None)]),
    # the abort still waiting when the next world is sent: one World carrying it
    ([abort(1), view(WORLD2)], [("world", 2, 1)]),
    # a world sent before the abort, or not right after it, or not newer, stays as it was
    ([view(WORLD2), abort(2)], [("world", 2, None), ("abort", 2)]),
    ([abort(1), b"pending", view(WORLD2)], [("abort", 1), b"pending", ("world", 2, None)]),
    ([abort(2), view(WORLD2)], [("abort", 2), ("world", 2, None)]),
    # two changes in a row: each abort rides with the world after it
    ([abort(1), view(WORLD2), abort(2), view(WORLD3)], [("world", 2, 1), ("world", 3, 2)]),
])
def test_an_abort_followed_by_a_newer_world_is_written_as_one_world_carrying_it(items, expected):
    assert shape(merged(items)) == expected


def test_the_merged_world_serializes_with_its_abort_and_the_notice_once_for_everyone():
    notice = abort(1)
    (item,) = merged([notice, view(WORLD2)])
    ev = pb.WatchEvent.FromString(item.serialized())
    assert ev.world.world_version == 2 and ev.world.rank == 1
    assert ev.world.aborted.world_version == 1 and ev.world.aborted.reason == notice.message.reason
    assert notice.serialized() is notice.serialized()
    assert pb.WatchEvent.FromString(notice.serialized()).abort.world_version == 1


def queued(stream):
    out = []
    while not stream.queue.empty():
        out.append(stream.queue.get_nowait())
    return shape(out)


def test_an_abort_is_paced_and_a_world_sent_meanwhile_reaches_every_stream_after_its_abort():
    n = fanout.CHUNK * 3 + 5
    views = WorldViews(2, members(n))

    async def body():
        streams = {m.worker_id: Stream() for m in views.members}
        out = FanOut(streams)
        notice = abort(1)
        out.send(((w, notice) for w in streams), paced=True)
        reached_at_once = sum(not s.queue.empty() for s in streams.values())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        reached_after_a_turn = sum(not s.queue.empty() for s in streams.values())
        out.send(views.pending(streams))          # the next world: at once, to every stream
        out.send([("w5", b"probe")])              # a later send comes after both
        got = {w: queued(s) for w, s in streams.items()}
        for _ in range(10):
            await asyncio.sleep(0)
        return reached_at_once, reached_after_a_turn, got, {w: queued(s) for w, s in streams.items()}
    at_once, after_turn, got, later = asyncio.run(body())
    assert at_once == fanout.CHUNK and fanout.CHUNK < after_turn < n   # a chunk at once, more each turn
    order = [m.worker_id for m in views.members]
    # Those the abort reached get it, then the world; the rest one World carrying it; w5 (in the
    # first chunk) its probe last.
    assert all(got[w] == [("abort", 1), ("world", 2, None)] for w in order[:after_turn] if w != "w5")
    assert all(got[w] == [("world", 2, 1)] for w in order[after_turn:])
    assert got["w5"] == [("abort", 1), ("world", 2, None), b"probe"]
    assert all(v == [] for v in later.values())   # nothing left over, nothing sent twice


def test_a_send_to_a_stream_that_closed_meanwhile_is_dropped_and_small_sends_go_at_once():
    async def body():
        streams = {"a": Stream(), "b": Stream()}
        out = FanOut(streams)
        out.send([("a", b"x"), ("gone", b"y")], paced=True)
        out.send([("b", b"z")])
        return queued(streams["a"]), queued(streams["b"])
    assert asyncio.run(body()) == ([b"x"], [b"z"])


def test_what_waits_for_a_stream_that_was_replaced_or_closed_meanwhile_is_dropped_not_handed_on():
    n = fanout.CHUNK * 2
    views = WorldViews(2, members(n))

    async def body():
        streams = {m.worker_id: Stream() for m in views.members}
        out = FanOut(streams)
        out.send(((w, abort(1)) for w in list(streams)), paced=True)
        last = views.members[-1].worker_id
        old = streams[last]
        streams[last] = Stream()            # it reattached: its snapshot says what is current
        del streams[views.members[-2].worker_id]   # it is gone
        out.send(views.pending(streams))    # the next world: the new stream gets it, alone
        for _ in range(5):
            await asyncio.sleep(0)
        return queued(old), queued(streams[last]), queued(streams[views.members[-3].worker_id])
    old, new, other = asyncio.run(body())
    assert old == [] and new == [("world", 2, None)] and other == [("world", 2, 1)]


@pytest.mark.parametrize("n, drains", [(fanout.CHUNK, False), (fanout.CHUNK + 1, True)])
def test_an_abort_to_at_most_a_chunk_of_streams_goes_at_once(n, drains):
    async def body():
        streams = {f"w{i}": Stream() for i in range(n)}
        out = FanOut(streams)
        out.send(((w, abort(1)) for w in streams), paced=True)
        return out._task is not None, sum(not s.queue.empty() for s in streams.values())
    assert asyncio.run(body()) == (drains, min(n, fanout.CHUNK))


def test_a_second_paced_send_during_a_drain_keeps_each_streams_order_and_close_drops_the_rest():
    n = fanout.CHUNK * 3

    async def body():
        streams = {f"w{i}": Stream() for i in range(n)}
        out = FanOut(streams)
        out.send(((w, abort(1)) for w in streams), paced=True)
        out.send(((w, b"pending 1") for w in streams), paced=True)
        for _ in range(10):
            await asyncio.sleep(0)
        got = {w: queued(s) for w, s in streams.items()}
        out.send(((w, abort(2)) for w in streams), paced=True)
        out.close()                            # leadership lost: nothing more is put
        for _ in range(10):
            await asyncio.sleep(0)
        after = [queued(s) for s in streams.values()]
        return got, after, out._task.cancelled() or out._task.done()
    got, after, ended = asyncio.run(body())
    assert all(v == [("abort", 1), b"pending 1"] for v in got.values())
    assert sum(len(v) for v in after) == fanout.CHUNK and ended   # the one chunk put at once


def _paced_abort_of_world_1(views, decided: list):
    """Every member of `views` with a stream, and the abort of world 1 on its way to them, paced;
    `decided[0]` is the newest world decided."""
    streams = {m.worker_id: Stream() for m in views.members}
    out = FanOut(streams, lambda: decided[0])
    out.send(((w, abort(1)) for w in streams), paced=True)
    return streams, out


def test_an_abort_waits_for_the_world_decided_after_it_and_rides_with_it():
    n = fanout.CHUNK * 4
    views = WorldViews(2, members(n))
    decided = [1]

    async def body():
        streams, out = _paced_abort_of_world_1(views, decided)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        before = sum(not s.queue.empty() for s in streams.values())
        decided[0] = 2                     # the next world is decided; its store write is under way
        for _ in range(20):
            await asyncio.sleep(0)
        await asyncio.sleep(fanout.HOLD_POLL_S * 3)
        held = sum(not s.queue.empty() for s in streams.values())
        out.send(views.pending(streams))   # ... and announced
        return before, held, {w: queued(s) for w, s in streams.items()}, out
    before, held, got, out = asyncio.run(body())
    assert fanout.CHUNK <= before < n and held == before   # nothing more was paced out meanwhile
    order = [m.worker_id for m in views.members]
    assert all(got[w] == [("abort", 1), ("world", 2, None)] for w in order[:held])
    assert all(got[w] == [("world", 2, 1)] for w in order[held:])
    assert not out._backlog


def test_an_abort_held_for_a_world_that_is_not_announced_goes_out_after_the_hold(monkeypatch):
    monkeypatch.setattr(fanout, "HOLD_MAX_S", 0.1)
    n = fanout.CHUNK * 3

    async def body():
        streams = {f"w{i}": Stream() for i in range(n)}
        out = FanOut(streams, lambda: 2)   # decided, but its write keeps failing: never announced
        out.send(((w, abort(1)) for w in streams), paced=True)
        await asyncio.wait_for(out._task, 5)
        return [queued(s) for s in streams.values()]
    assert all(v == [("abort", 1)] for v in asyncio.run(body()))


def test_what_is_left_of_an_abort_after_its_world_is_announced_is_paced_out():
    n = fanout.CHUNK * 3
    views = WorldViews(2, members(n // 2))   # half the old world is in the next one

    async def body():
        streams = {f"w{i}": Stream() for i in range(n)}
        out = FanOut(streams, lambda: 2)
        out.send(((w, abort(1)) for w in streams), paced=True)
        out.send(views.pending(streams))
        await asyncio.wait_for(out._task, 5)
        return {w: queued(s) for w, s in streams.items()}
    got = asyncio.run(body())
    first = [f"w{i}" for i in range(fanout.CHUNK)]
    assert all(got[w] == [("abort", 1), ("world", 2, None)] for w in first)
    assert all(got[m.worker_id] == [("world", 2, 1)] for m in views.members if m.worker_id not in first)
    assert all(got[f"w{i}"] == [("abort", 1)] for i in range(n // 2, n))


def test_the_abort_of_the_next_world_gets_a_hold_of_its_own(monkeypatch):
    # A member of the world announced after a hold died already: its abort, sent while the drain
    # of the first still runs, is held for the world after it as long as the first was.
    monkeypatch.setattr(fanout, "HOLD_MAX_S", 0.3)
    n = fanout.CHUNK * 4
    views = WorldViews(2, members(n))
    decided = [1]

    async def body():
        streams, out = _paced_abort_of_world_1(views, decided)
        decided[0] = 2
        await asyncio.sleep(0.25)                                  # most of the first hold
        out.send(views.pending(streams))                           # world 2 announced ...
        out.send(((w, abort(2)) for w in streams), paced=True)     # ... and aborted
        decided[0] = 3
        await asyncio.sleep(0.15)                                  # well inside a hold of its own
        return sum(("abort", 2) in queued(s) for s in streams.values())
    assert asyncio.run(body()) == 0
