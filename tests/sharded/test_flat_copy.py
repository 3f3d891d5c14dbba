"""The flat copy a commit sends to its buddy (elastic.sharded.transfer): one copy of the shards,
a layout both sides compute from the table, and a refusal of anything else; after a reshard,
the same copy put together from the rows the buddy held and the ones it was sent."""

import pytest
import torch

from elastic.sharded.reshard import Generation, Holding, buddy_of, buddy_plan, chunk_rows, decide
from elastic.sharded.transfer import (assemble_buddy, buddy_sent_bytes, check_buddy, flat_copy, flat_layout,
                                      pack_for_buddy)

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


# ---------------------------------------------------------------- the copy after a reshard
FULL = {key: (torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 1000).to(getattr(torch, d[6:]))
        for i, (key, shape, d) in enumerate(TABLE)}


def chunks(rank, size):
    """Rank ``rank`` of ``size``'s rows of every tensor, as a commit's copy holds them."""
    return {k: t[slice(*chunk_rows(t.shape[0], size)[rank])].clone() for k, t in FULL.items()}


def copies(old, old_size):
    """The own and buddy copy old rank ``old`` kept of a commit (None: it held none; a world of
    one keeps no buddy copy)."""
    if old is None:
        return None, None
    return {"shards": chunks(old, old_size)}, ({"shards": chunks((old - 1) % old_size, old_size)}
                                               if old_size > 1 else None)


def holding(g, old, pending):
    """What a survivor announces: ``g`` as old rank ``old``, promoted or (``pending``) only sent."""
    if old is None:
        return Holding()
    return Holding(pending=(g, old)) if pending else Holding(committed=(g, old))


@pytest.mark.parametrize("old_size, survivors, new_size",
                         [(4, [0, 1, 2], 3), (4, [3, 1], 2), (3, [0, 1, 2, None], 4), (2, [1, 0, None], 3),
                          (4, [0, 1, 2, 3], 4), (5, [4, 0, 2], 3), (1, [0, None], 2), (1, [None, 0, None], 3)])
@pytest.mark.parametrize("pending", [False, True])
def test_a_buddy_copy_put_together_after_a_reshard_is_bitwise_the_owners_flat_copy(old_size, survivors, new_size,
                                                                                   pending):
    # pending: every survivor but the first holds the commit only as sent, not promoted (it
    # counts as held once any rank promoted it)
    g = Generation(8, 3, old_size)
    first = next(i for i, old in enumerate(survivors) if old is not None)
    holders = decide([holding(g, old, pending and i != first) for i, old in enumerate(survivors)]).holders
    pieces = buddy_plan([shape[0] for _, shape, _ in TABLE], old_size, holders, new_size)
    whole = 0
    for owner in range(new_size):
        flat, views = flat_copy(chunks(owner, new_size), TABLE, owner, new_size, step=8, version=11)
        sent = pack_for_buddy(pieces, owner, views, TABLE, new_size, 8, 11)
        assert sent.numel() == buddy_sent_bytes(pieces, owner, TABLE)
        own, buddy = copies(survivors[buddy_of(owner, new_size)], old_size)
        got, got_views = assemble_buddy(sent.clone(), pieces, owner, TABLE, new_size, 8, 11, old_size, own, buddy)
        assert torch.equal(got, flat)   # header, shards and zeroed padding alike
        assert all(torch.equal(got_views[k], v) for k, v in views.items())
        whole += flat.numel()
    if None not in survivors and new_size < old_size:
        assert sum(buddy_sent_bytes(pieces, o, TABLE) for o in range(new_size)) < whole / 2


@pytest.mark.parametrize("change, match", [
    (lambda f: f[:-1], "bytes, the rows it lacks take"),
    (lambda f: torch.cat([f, torch.zeros(8, dtype=torch.uint8)]), "bytes, the rows it lacks take"),
    (lambda f: torch.cat([torch.tensor([9, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8), f[8:]]), "commit 9"),
])
def test_rows_sent_after_a_reshard_of_another_size_or_commit_are_refused(change, match):
    g = Generation(8, 3, 3)
    holders = decide([Holding(committed=(g, 0)), Holding(committed=(g, 1)), Holding()]).holders
    pieces = buddy_plan([shape[0] for _, shape, _ in TABLE], 3, holders, 3)
    _, views = flat_copy(chunks(1, 3), TABLE, 1, 3, step=8, version=11)
    sent = pack_for_buddy(pieces, 1, views, TABLE, 3, 8, 11)   # to new 2, which held nothing: all of it
    assert sent.numel() > 16
    with pytest.raises(ValueError, match=match):
        assemble_buddy(change(sent), pieces, 1, TABLE, 3, 8, 11, 3, None, None)
