"""When the server freezes its objects out of the cyclic collector's sight (rendezvous/server/collector.py)."""
from __future__ import annotations

import asyncio
import gc

from rendezvous.server.collector import Collector


class FakeGc:
    def __init__(self):
        self.calls = []

    def collector(self, workers):
        return Collector(lambda: workers[0], large=100, freeze=lambda: self.calls.append("freeze"),
                         unfreeze=lambda: self.calls.append("unfreeze"),
                         collect_young=lambda: self.calls.append("collect young"))


def test_a_small_server_leaves_the_collector_alone():
    fake, workers = FakeGc(), [100]
    c = fake.collector(workers)
    c.tend()
    assert fake.calls == [] and not c.frozen


def test_a_large_server_collects_the_young_generations_then_freezes_the_survivors_each_time():
    fake, workers = FakeGc(), [101]
    c = fake.collector(workers)
    c.tend()
    c.tend()
    assert fake.calls == ["collect young", "freeze"] * 2 and c.frozen


def test_once_no_large_job_is_held_everything_is_unfrozen_once():
    fake, workers = FakeGc(), [5000]
    c = fake.collector(workers)
    c.tend()
    workers[0] = 10
    c.tend()
    c.tend()
    assert fake.calls == ["collect young", "freeze", "unfreeze"] and not c.frozen


def test_stopping_unfreezes_what_was_frozen():
    fake, workers = FakeGc(), [5000]
    c = fake.collector(workers)
    c.tend()
    c.stop()
    assert fake.calls[-1] == "unfreeze" and not c.frozen


def test_with_the_real_collector_frozen_objects_are_out_of_its_generations_until_released():
    async def run():
        c = Collector(lambda: 2, large=1)
        kept = [[i] for i in range(1000)]
        c.tend()
        frozen = gc.get_freeze_count()
        c.stop()
        return kept, frozen, gc.get_freeze_count()
    kept, frozen, after = asyncio.run(run())
    assert frozen >= len(kept) and after == 0
