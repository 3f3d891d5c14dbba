"""ElasticSampler: equal shards, nothing skipped, repeats only from padding, across re-partitions."""

from __future__ import annotations

import numpy as np
import pytest

from elastic.state.sampler import ElasticSampler, committed_attrs, partition, processed_indices


@pytest.mark.parametrize("remaining,size,expected", [
    ([0, 1, 2, 3], 2, [[0, 2], [1, 3]]),
    ([0, 1, 2, 3, 4], 2, [[0, 2, 4], [1, 3, 0]]),          # one padding repeat
    ([5, 6, 7], 4, [[5], [6], [7], [5]]),
    ([9], 3, [[9], [9], [9]]),                            # size-1 = 2 repeats at most
    ([], 3, [[], [], []]),
    ([4, 3, 2, 1], 1, [[4, 3, 2, 1]]),
])
def test_partition_table(remaining, size, expected):
    assert [s.tolist() for s in partition(remaining, size)] == expected


@pytest.mark.parametrize("remaining,size,count,expected", [
    ([0, 1, 2, 3, 4, 5], 2, 0, []),
    ([0, 1, 2, 3, 4, 5], 2, 1, [0, 1]),
    ([0, 1, 2, 3, 4, 5], 2, 2, [0, 1, 2, 3]),
    ([0, 1, 2, 3, 4], 2, 3, [0, 1, 2, 3, 4]),              # the padded 0 counted once
    ([7, 8, 9], 2, 5, [7, 8, 9]),                          # count beyond the shard
])
def test_processed_indices_table(remaining, size, count, expected):
    assert processed_indices(remaining, size, count).tolist() == expected


def _epoch(samplers, batch, changes):
    """Runs one epoch over `samplers` (one per rank) in lock-step; `changes` maps a batch number to
    a new world size. Returns how often each index was trained on."""
    counts = {}
    step = 0
    while True:
        shards = [list(iter(s)) for s in samplers]
        lengths = {len(sh) for sh in shards}
        assert len(lengths) == 1, f"unequal shards: {lengths}"
        n = lengths.pop()
        if n == 0:
            return counts
        changed = False
        for b in range(0, n, batch):
            for s, sh in zip(samplers, shards):
                for i in sh[b:b + batch]:
                    counts[i] = counts.get(i, 0) + 1
                s.record_batch(b // batch, len(sh[b:b + batch]))
            step += 1
            if step in changes:
                # Commit on rank 0, the new world loads it (as sync does) and re-partitions.
                sd = samplers[0].state_dict()
                samplers = [ElasticSampler(range(samplers[0].dataset_len), num_replicas=changes[step], rank=r)
                            for r in range(changes[step])]
                for s in samplers:
                    s.load_state_dict(sd)
                changed = True
                break
        if not changed:
            return counts


@pytest.mark.parametrize("n,batch,changes", [
    (100, 4, {}),
    (101, 4, {3: 3}),
    (97, 5, {2: 4, 5: 2, 6: 5}),
    (10, 3, {1: 7}),
])
def test_no_sample_skipped_and_repeats_bounded_by_padding(n, batch, changes):
    samplers = [ElasticSampler(range(n), num_replicas=2, rank=r) for r in range(2)]
    counts = _epoch(samplers, batch, changes)
    assert sorted(counts) == list(range(n)), "a sample was skipped"
    repeats = sum(counts.values()) - n
    bound = sum(size - 1 for size in [2] + list(changes.values()))
    assert repeats <= bound


def test_set_epoch_is_idempotent_and_new_epochs_reshuffle():
    s = ElasticSampler(range(20), shuffle=True, seed=3, num_replicas=2, rank=0)
    first = list(iter(s))
    s.record_batch(0, 4)
    s.set_epoch(0)  # same epoch: progress kept
    assert list(iter(s)) == first[4:]
    s.set_epoch(1)
    assert len(list(iter(s))) == 10 and list(iter(s)) != first


def test_state_dict_round_trip_resumes_where_it_stopped():
    a = ElasticSampler(range(30), num_replicas=3, rank=1)
    shard = list(iter(a))
    a.record_batch(0, 4)
    b = ElasticSampler(range(30), num_replicas=3, rank=1)
    b.load_state_dict(a.state_dict())
    assert list(iter(b)) == shard[4:]
    assert np.array_equal(b.state_dict()["remaining"], a.state_dict()["remaining"])


# ------------------------------------------------------------- what a DistributedSampler user expects
def test_len_is_the_ranks_share_of_the_whole_epoch_from_first_batch_to_last():
    import torch

    s = ElasticSampler(range(10), num_replicas=2, rank=0)
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=2, sampler=s)
    lens = []
    for i, x in enumerate(loader):
        s.record_batch(i, len(x))
        lens.append((len(s), len(loader)))
    assert lens == [(5, 3)] * 3                         # never shrinking, never 0 at the end
    assert s.remaining_samples() == 0 and s.epoch_finished()
    s.set_epoch(1)
    assert (len(s), len(loader), s.remaining_samples()) == (5, 3, 5)


def test_after_a_new_world_mid_epoch_len_is_the_new_worlds_share_and_the_loader_yields_the_rest():
    a = ElasticSampler(range(10), num_replicas=2, rank=0)
    list(iter(a))
    a.record_batch(0, 2)                                # 2 samples per rank: 4 of 10 done
    b = ElasticSampler(range(10), num_replicas=3, rank=2)
    b.load_state_dict(a.state_dict())
    assert len(b) == 4                                  # ceil(10 / 3)
    assert b.remaining_samples() == 2 == len(list(iter(b)))   # ceil(6 / 3) still to do


@pytest.mark.parametrize("attrs, finished, sampler_epoch, committed", [
    ({"epoch": 3, "batch": 9}, True, 3, {"epoch": 4, "batch": 0}),     # the end-of-epoch commit
    ({"epoch": 3, "batch": 9}, False, 3, {"epoch": 3, "batch": 9}),    # mid-epoch
    ({"epoch": 4, "batch": 0}, True, 3, {"epoch": 4, "batch": 0}),     # epoch moved on by hand already
    ({"epoch": 3}, True, 3, {"epoch": 4}),
    ({"epoch": 3, "batch": "x"}, True, 3, {"epoch": 4, "batch": "x"}),
    ({"epoch": 3.0}, True, 3, {"epoch": 3.0}),                         # not an epoch counter
    ({"step": 3}, True, 3, {"step": 3}),
])
def test_a_finished_epoch_is_committed_as_the_next(attrs, finished, sampler_epoch, committed):
    s = ElasticSampler(range(4), num_replicas=1, rank=0)
    s.set_epoch(sampler_epoch)
    if finished:
        list(iter(s))
        s.record_batch(0, 4)
    assert committed_attrs(attrs, {"sampler": s}) == committed
    assert committed_attrs(attrs, {}) == attrs


def _finished_epoch_state(epochs_done: int):
    import elastic

    s = ElasticSampler(range(6), num_replicas=1, rank=0)
    state = elastic.TorchState(sampler=s, epoch=0, batch=0)
    for state.epoch in range(epochs_done):
        s.set_epoch(state.epoch)
        for state.batch, _ in enumerate([list(iter(s))]):
            s.record_batch(state.batch, 6)
    return state, s


def test_a_restore_after_the_end_of_epoch_commit_resumes_at_the_next_epoch():
    state, s = _finished_epoch_state(1)
    state.take_snapshot()                               # the end-of-epoch commit's copy
    state.epoch, state.batch = 0, 7                     # where a failure found it
    state.restore()
    assert (state.epoch, state.batch) == (1, 0)
    s.set_epoch(state.epoch)
    assert s.remaining_samples() == 6                   # a whole new epoch, not 0 batches of the old


def test_a_join_after_the_end_of_epoch_commit_syncs_the_next_epoch():
    state, _ = _finished_epoch_state(1)
    # What the sync root sends is its live state: the finished epoch already counts as done.
    assert state.live()["attrs"] == {"epoch": 1, "batch": 0}
    assert state.epoch == 0                             # the live attribute itself is left alone


def test_a_commit_without_record_batch_says_the_epoch_starts_again(caplog):
    s = ElasticSampler(range(8), num_replicas=1, rank=0)
    list(iter(s))
    with caplog.at_level("WARNING", logger="elastic"):
        s.state_dict()
        s.state_dict()                                  # once per epoch
    assert [r.getMessage() for r in caplog.records] == [
        "ElasticSampler: committing epoch 0 with no record_batch() call in it: its progress is unknown, so a "
        "restore or a new world starts epoch 0 again from its first sample; call sampler.record_batch(batch_idx, "
        "len(batch)) after each batch"]
    caplog.clear()
    fresh = ElasticSampler(range(8), num_replicas=1, rank=0)
    with caplog.at_level("WARNING", logger="elastic"):
        fresh.state_dict()                              # nothing handed out yet: nothing to say
        list(iter(fresh))
        fresh.record_batch(0, 2)
        fresh.state_dict()
    assert caplog.records == []
