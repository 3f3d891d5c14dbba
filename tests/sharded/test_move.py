"""The rows a reshard moves (elastic.sharded.transfer.move) over a real ring: every new rank's
shards bitwise the committed rows of its new chunk, each rank receiving only the rows it takes
or passes on (forward and backward shifts), on TCP and shared memory."""

import functools

import pytest
import torch

from elastic.sharded import reshard
from elastic.sharded.transfer import flat_buffer, move
from tests.native.harness import TRANSPORTS, run_world

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane

TABLE = [["model.w", [96, 5], "torch.float32"], ["model.b", [7], "torch.bfloat16"],
         ["optim.w.exp_avg", [96, 5], "torch.float32"], ["model.e", [2, 3], "torch.int64"]]


def full(key, shape, dtype):
    """The committed full tensor of ``key``: every element distinct."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64) + 1000 * len(key)).reshape(shape).to(getattr(torch, dtype[6:]))


def shards(old, old_size):
    return {key: full(key, shape, dtype)[slice(*reshard.chunk_rows(shape[0], old_size)[old])]
            for key, shape, dtype in TABLE}


def holders_of(old_size, lost):
    """Who holds each old rank's shards when ``lost`` are gone: the survivors keep their order
    and come first (joiners after them hold nothing); old rank i's buddy copy is on i + 1."""
    new_of = {old: new for new, old in enumerate(r for r in range(old_size) if r not in lost)}
    holders = []
    for i in range(old_size):
        h = []
        if i in new_of:
            h.append((new_of[i], reshard.OWN))
        if (i + 1) % old_size in new_of:
            h.append((new_of[(i + 1) % old_size], reshard.BUDDY))
        holders.append(tuple(sorted(h, key=lambda x: (x[1], x[0]))))
    return tuple(holders), {new: old for old, new in new_of.items()}


def _move(comm, old_size, lost):
    holders, old_of = holders_of(old_size, lost)
    decision = reshard.Resume(reshard.Generation(7, 3, old_size), holders, root=0)
    me = comm.rank
    own = buddy = None
    if me in old_of:
        own = {"shards": shards(old_of[me], old_size)}
        buddy = {"shards": shards((old_of[me] - 1) % old_size, old_size)}
    _, views = flat_buffer(TABLE, me, comm.size, 7, 9)
    wire = {"bytes": 0, "backward": 0}
    shift_into_ = comm.shift_into_

    def counted(input, output, *, backward=False):   # what the ring delivered (its sizes are checked)
        shift_into_(input, output, backward=backward)
        wire["bytes"] += output.numel() * output.element_size()
        wire["backward"] += bool(backward)
        return output

    comm.shift_into_ = counted
    received = move(comm, decision, TABLE, own, buddy, views)
    assert received == wire["bytes"], (received, wire)
    right = all(torch.equal(views[key], full(key, shape, dtype)[slice(*reshard.chunk_rows(shape[0], comm.size)[me])])
                for key, shape, dtype in TABLE)
    return right, received, wire["backward"]


def expected_received(old_size, lost, new_size):
    """What each new rank receives under the relay, and what a ring allgather would hand it."""
    holders, _ = holders_of(old_size, lost)
    rows = [shape[0] for _, shape, _ in TABLE]
    transfers = reshard.plan(rows, old_size, holders, new_size)
    per_row = [torch.empty(shape[1:], dtype=getattr(torch, dtype[6:])).numel() *
               torch.empty((), dtype=getattr(torch, dtype[6:])).element_size() for _, shape, dtype in TABLE]
    nbytes = [(t.stop - t.start) * per_row[t.key] for t in transfers]
    relayed = [0] * new_size
    for hop in reshard.relay([(t.src, t.dst) for t in transfers], new_size):
        for i, sender in hop.moves:
            relayed[(sender + (1 if hop.forward else -1)) % new_size] += nbytes[i]
    moved = sum(b for b, t in zip(nbytes, transfers) if t.src != t.dst)
    allgather = [moved - sum(b for b, t in zip(nbytes, transfers) if t.src == r != t.dst) for r in range(new_size)]
    taken = [sum(b for b, t in zip(nbytes, transfers) if t.dst == r != t.src) for r in range(new_size)]
    return relayed, allgather, taken


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("old_size, lost, new_size", [
    (4, (1,), 3),      # one of four killed: every moved row goes one link backwards
    (5, (4,), 4),      # the last one
    (6, (1, 4), 4),    # two non-buddies
    (3, (), 4),        # a joiner
    (3, (), 5),
    (4, (2,), 4),      # one lost and one joined: the same size, another layout
])
def test_moved_rows_land_bitwise_and_each_rank_receives_only_what_it_takes_or_passes_on(old_size, lost, new_size,
                                                                                        transport):
    results = run_world(new_size, functools.partial(_move, old_size=old_size, lost=lost), transport=transport,
                        start_method="forkserver")
    relayed, allgather, taken = expected_received(old_size, lost, new_size)
    assert [right for right, _, _ in results] == [True] * new_size, results
    received = [r for _, r, _ in results]
    assert received == relayed, (results, relayed)
    # Independent of the relay: a rank receives at least the rows it takes, and never more than
    # an allgather would have handed it.
    assert all(t <= r <= a for t, r, a in zip(taken, received, allgather)), (taken, received, allgather)
    if new_size == old_size - 1 == old_size - len(lost):
        # A shrink by one: a rank receives exactly the rows it takes (over backward shifts),
        # where an allgather would have handed it every moved row it did not send.
        assert received == taken, (received, taken)
        assert sum(received) < sum(allgather), (received, allgather)
        assert all(backward > 0 for _, _, backward in results), results
