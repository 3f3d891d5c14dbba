"""ElasticSampler: equal shards, nothing skipped, repeats only from padding, across re-partitions."""

from __future__ import annotations

import numpy as np
import pytest

from elastic.sampler import ElasticSampler, partition, processed_indices


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
