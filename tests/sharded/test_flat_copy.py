"""The flat copy a commit sends to its buddy (elastic.sharded_transfer): one copy of the shards,
a layout both sides compute from the table, and a refusal of anything else."""

import pytest
import torch

from elastic.sharded_transfer import check_buddy, flat_copy, flat_layout

TABLE = [["model.w", [10, 3], "torch.float32"], ["model.b", [10], "torch.bfloat16"],
         ["optim.w.exp_avg", [10, 3], "torch.float32"], ["model.e", [2, 5], "torch.int64"]]


def shards_of(rank, size):
    out = {}
    for key, shape, dtype in TABLE:
        n = -(-shape[0] // size)
        rows = max(0, min(shape[0], (rank + 1) * n) - rank * n)
        out[key] = torch.arange(rows * (shape[1] if len(shape) > 1 else 1)).reshape(rows, *shape[1:]).to(
            getattr(torch, dtype.split(".")[1])) + rank
    return out


@pytest.mark.parametrize("size", [1, 3, 4, 7])
def test_the_buddy_reads_the_senders_shards_bitwise_from_its_bytes(size):
    for rank in range(size):
        shards = shards_of(rank, size)
        flat, views = flat_copy(shards, TABLE, rank, size, step=5, version=9)
        assert flat.numel() == flat_layout(TABLE, rank, size)[0]
        got = check_buddy(flat.clone(), TABLE, rank, size, 5, 9)
        for key, t in shards.items():
            assert got[key].dtype == t.dtype and torch.equal(got[key], t) and torch.equal(views[key], t)


def test_the_copy_does_not_alias_the_live_shards():
    shards = shards_of(0, 2)
    _, views = flat_copy(shards, TABLE, 0, 2, 1, 1)
    shards["model.w"].add_(100)
    assert not torch.equal(views["model.w"], shards["model.w"])


@pytest.mark.parametrize("change, match", [
    (lambda f: f[:-64], "bytes, its flat copy has"),
    (lambda f: torch.cat([f, torch.zeros(64, dtype=torch.uint8)]), "bytes, its flat copy has"),
    (lambda f: torch.cat([torch.tensor([6, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8), f[8:]]), "commit 6"),
])
def test_a_buddy_copy_of_another_size_or_commit_is_refused(change, match):
    flat, _ = flat_copy(shards_of(1, 3), TABLE, 1, 3, step=5, version=9)
    with pytest.raises(ValueError, match=match):
        check_buddy(change(flat), TABLE, 1, 3, 5, 9)
