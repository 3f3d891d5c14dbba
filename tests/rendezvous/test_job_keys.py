"""A job over many store keys (rendezvous/server/job_keys.py): what a write puts is what changed,
no transaction exceeds etcd's limits whatever the job's size, and what is read back is what was
decided, across a write cut short between its transactions and from the one-value layout of
earlier versions."""
from __future__ import annotations

import dataclasses

import pytest

from rendezvous.server import decision as d
from rendezvous.server import job_json, job_keys
from rendezvous.server.store import MemoryStore

from .rdzv_helpers import run_async

PREFIX = "/t/keys"


def job(n: int, per_host: int = 8) -> d.JobState:
    """A running job of n workers whose world holds them all."""
    workers = {f"w{i:05d}": d.Worker(f"w{i:05d}", f"host-{i // per_host}", f"10.0.{i // 250 % 250}.{i % 250}:4000",
                                     -1, i, 1.0, True, f"{i:064x}", 1) for i in range(n)}
    state = dataclasses.replace(d.new_job("j", d.JobSpec(1, n, 60.0), 0.0), workers=workers, phase=d.Phase.RUNNING)
    world = d.compute_world(state, 1.0)
    return dataclasses.replace(state, world=world, world_version=1)


def without(state: d.JobState, *gone: str) -> d.JobState:
    """The job after `gone` failed and the next world formed without them."""
    workers = {k: w for k, w in state.workers.items() if k not in gone}
    state = dataclasses.replace(state, workers=workers)
    return dataclasses.replace(state, world=d.compute_world(state, 2.0), world_version=state.world_version + 1)


async def write(store: MemoryStore, state: d.JobState, stored: job_keys.StoredJob,
                stop_after_staged: bool = False) -> job_keys.StoredJob:
    p = job_keys.plan(PREFIX, state, stored)
    for batch in p.staged:
        assert len(batch) <= job_keys.WRITE_OPS and sum(map(len, batch.values())) <= job_keys.WRITE_BYTES
        assert await store.commit(batch) is not None
    if stop_after_staged:
        return stored
    assert len(p.puts) + len(p.deletes) <= job_keys.WRITE_OPS
    rev = await store.commit(p.puts, p.deletes, expected=p.expected)
    assert rev is not None
    p.stored.revision = rev
    for i in range(0, len(p.after), job_keys.WRITE_OPS):
        assert await store.commit({}, p.after[i:i + job_keys.WRITE_OPS]) is not None
    return p.stored


async def read(store: MemoryStore):
    (got,) = job_keys.parse(PREFIX, await store.get_prefix(job_keys.root(PREFIX)))
    return got


@pytest.mark.parametrize("n", [1, 40, 3000])
def test_what_is_read_back_is_what_was_written(n):
    async def body():
        store = MemoryStore()
        state = job(n)
        stored = await write(store, state, job_keys.StoredJob())
        assert (await read(store))[0] == state
        state = without(state, "w00000")
        stored = await write(store, state, stored)
        got, stored_read = await read(store)
        assert got == state and stored_read.garbage == []
        # Nothing is left of what no state reads: one key a worker, the head, the world's chunks.
        assert len(await store.get_prefix(job_keys.root(PREFIX))) == n - 1 + 1 + -(-(n - 1) // job_keys.WORLD_CHUNK)
    run_async(body())


@pytest.mark.slow
def test_a_failure_in_a_job_of_16384_writes_what_changed():
    state = job(16384)
    stored = job_keys.first_write(PREFIX, state).stored
    # The failed worker is gone, its world not formed yet: the head and one deletion.
    evicted = dataclasses.replace(state, workers={k: w for k, w in state.workers.items() if k != "w00007"},
                                  aborted_version=1)
    p = job_keys.plan(PREFIX, evicted, stored)
    assert p.staged == [] and list(p.puts) == [job_keys.head_key(PREFIX, "j")] and len(p.deletes) == 1
    assert len(p.head) < 1024
    # A worker's record changing (it attached, reported a step): that key and the head.
    attached = dataclasses.replace(state, workers={**state.workers, "w00009": dataclasses.replace(
        state.workers["w00009"], commit_step=5)})
    p = job_keys.plan(PREFIX, attached, stored)
    assert len(p.puts) == 2 and sum(map(len, p.puts.values())) < 2048
    # The next world: its rank order, ~50 bytes a member, in transactions etcd takes.
    p = job_keys.plan(PREFIX, without(state, "w00007"), stored)
    world_bytes = sum(len(v) for batch in p.staged + [p.puts] for k, v in batch.items() if "/world/" in k)
    assert 16383 * 40 < world_bytes < 16383 * 100
    assert all(len(b) <= job_keys.WRITE_OPS and sum(map(len, b.values())) <= job_keys.WRITE_BYTES for b in p.staged)


def test_a_write_cut_short_before_its_head_is_not_read_and_is_cleaned_up_by_the_next():
    async def body():
        store = MemoryStore()
        state = job(3000)
        stored = await write(store, state, job_keys.StoredJob())
        nxt = without(state, "w00001", "w00002")
        # 200 workers' records changed too: more than one transaction carries, so it is staged.
        nxt = dataclasses.replace(nxt, workers={k: dataclasses.replace(w, commit_step=7) if int(k[1:]) < 203 else w
                                                for k, w in nxt.workers.items()})
        assert job_keys.plan(PREFIX, nxt, stored).staged
        await write(store, nxt, stored, stop_after_staged=True)    # the leader died here
        got, stored = await read(store)
        assert got == state and stored.garbage                      # its staged keys are not read
        stored = await write(store, nxt, stored)                    # the next leader writes again
        got, stored = await read(store)
        assert got == nxt and stored.garbage == []
    run_async(body())


def test_a_job_stored_as_one_value_by_an_earlier_version_is_read_and_moved():
    async def body():
        store = MemoryStore()
        state = job(20)
        await store.put(f"{PREFIX}/jobs/j", job_json.to_json(state))
        got, stored = await read(store)
        assert got == state and stored.legacy_key == f"{PREFIX}/jobs/j"
        nxt = without(state, "w00003")
        await write(store, nxt, stored)
        assert await store.get(f"{PREFIX}/jobs/j") is None
        assert (await read(store))[0] == nxt
    run_async(body())
