"""reduce_scatter_ and allgather_into_: numpy's answer for every dtype, op and block layout,
the input left as it was, on TCP and shared memory."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import elastic

from .cases import DTYPES, OPS, make_input, raw, reference
from .harness import TRANSPORTS, mixed_hosts, run_world

CONFIGS = {
    "default": elastic.CommConfig(timeout=60),
    # Many short segments: blocks that end mid-segment and segments smaller than a block.
    "short-segments": elastic.CommConfig(timeout=60, segment_bytes=4096),
}


def _layouts(n: int) -> list:
    """Per-rank element counts: equal blocks of several sizes, and uneven ones with empty blocks."""
    uneven = [(7 * r + 3) % 11 for r in range(n)]
    uneven[0] = 0
    return [[0] * n, [1] * n, [1001] * n, [70_001] * n, uneven, [5000 + 97 * r for r in range(n)]]


def _reduce_scatter_matrix(comm):
    failures = []
    for dtype in DTYPES:
        for op in OPS:
            for counts in _layouts(comm.size):
                total = sum(counts)
                inp = make_input(comm.rank, dtype, total, op)
                before = raw(inp)
                out = torch.empty(counts[comm.rank], dtype=inp.dtype)
                comm.reduce_scatter_(out, inp, op, counts=counts)
                want = reference([make_input(r, dtype, total, op) for r in range(comm.size)], dtype, op)
                lo = sum(counts[:comm.rank])
                key = f"{dtype}/{op.name}/{counts[:3]}"
                if raw(out) != raw(want[lo:lo + counts[comm.rank]]):
                    failures.append(key + ": wrong block")
                if raw(inp) != before:
                    failures.append(key + ": input changed")
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_reduce_scatter_gives_each_rank_its_block_of_the_reduction(n, config, transport):
    for rank, failures in enumerate(run_world(n, _reduce_scatter_matrix, config=CONFIGS[config], timeout=240,
                                              transport=transport)):
        assert failures == [], f"rank {rank}: {failures}"


def _allgather_into_matrix(comm):
    failures = []
    for dtype in [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.int8, torch.complex64]:
        for counts in _layouts(comm.size):
            blocks = [(torch.arange(c, dtype=torch.float64) * (r + 1)).to(dtype) for r, c in enumerate(counts)]
            out = torch.empty(sum(counts), dtype=dtype)
            comm.allgather_into_(out, blocks[comm.rank], counts=counts)
            if not torch.equal(out, torch.cat(blocks)):
                failures.append(f"{dtype}/{counts[:3]}")
    return failures


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_allgather_into_lays_every_rank_block_out_in_rank_order(n, transport):
    for rank, failures in enumerate(run_world(n, _allgather_into_matrix, transport=transport)):
        assert failures == [], f"rank {rank}: {failures}"


def _output_inside_the_input(comm):
    # The output as a view of the input: exactly the rank's own block (an in-place
    # reduce-scatter), or straddling other ranks' blocks, which the ring still reads.
    n, c = comm.size, 4099
    got = {}
    for dtype in ("float32", "bfloat16", "int64"):
        for op in (elastic.Sum, elastic.Average, elastic.Max):
            want = reference([make_input(r, dtype, n * c, op) for r in range(n)], dtype, op)
            mine = want[comm.rank * c:(comm.rank + 1) * c]
            for where, lo in (("own block", comm.rank * c), ("straddling", (comm.rank * c + c // 2) % ((n - 1) * c))):
                inp = make_input(comm.rank, dtype, n * c, op)
                out = inp[lo:lo + c]
                comm.reduce_scatter_(out, inp, op)
                got[f"{dtype}/{op.name}/{where}"] = raw(out) == raw(mine)
    return got


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_output_inside_the_input_gets_the_right_block(transport):
    for rank, got in enumerate(run_world(3, _output_inside_the_input, transport=transport,
                                         config=CONFIGS["short-segments"])):
        assert all(got.values()), f"rank {rank}: {got}"


def _bad_calls(comm):
    said = []
    inp = torch.ones(6)
    for call in (lambda: comm.reduce_scatter_(torch.empty(3), inp, elastic.Sum, counts=[3, 4]),
                 lambda: comm.reduce_scatter_(torch.empty(3), inp, elastic.Sum, counts=[-1, 7]),
                 lambda: comm.reduce_scatter_(torch.empty(2), inp, elastic.Sum),
                 lambda: comm.reduce_scatter_(torch.empty(3, dtype=torch.float64), inp, elastic.Sum),
                 lambda: comm.allgather_into_(torch.empty(5), torch.ones(3)),
                 lambda: comm.allgather_into_(torch.empty(6), torch.ones(2))):
        try:
            call()
            said.append("no error")
        except ValueError as e:
            said.append(str(e))
    # The ring is still usable: a refused call never reached it.
    out = torch.empty(3)
    comm.reduce_scatter_(out, torch.arange(6, dtype=torch.float32), elastic.Sum)
    return said, out.tolist()


def test_bad_counts_and_shapes_are_refused_before_the_ring_moves():
    for rank, (said, out) in enumerate(run_world(2, _bad_calls)):
        assert "no error" not in said, said
        assert any("counts" in s for s in said) and any("dtype" in s for s in said), said
        assert out == [2.0 * (3 * rank + i) for i in range(3)]


def _mismatched_counts(comm):
    counts = [2, 2] if comm.rank == 0 else [1, 3]
    try:
        comm.reduce_scatter_(torch.empty(counts[comm.rank]), torch.ones(4), elastic.Sum, counts=counts)
    except elastic.CollectiveMismatchError as e:
        return "mismatch", str(e)
    except elastic.WorkerLostError as e:
        return "lost", e.reason
    return "none", ""


def test_ranks_passing_different_counts_fail_with_a_mismatch_not_wrong_numbers():
    results = run_world(2, _mismatched_counts)
    assert {kind for kind, _ in results} <= {"mismatch", "lost"}
    assert "mismatch" in {kind for kind, _ in results}, results


def _shift_sizes(comm):
    got = {}
    for name, size_of in (("uneven", lambda r: 1000 * r + 7), ("empty", lambda r: 0),
                          ("some empty", lambda r: 0 if r % 2 else 5_000_003), ("large", lambda r: 3 << 20)):
        mine = torch.full((size_of(comm.rank),), comm.rank + 1, dtype=torch.uint8)
        out = comm.shift(mine)
        prev = (comm.rank - 1) % comm.size
        got[name] = out.numel() == size_of(prev) and bool((out == prev + 1).all())
    arr = comm.shift(np.arange(comm.rank + 3, dtype=np.float64))
    got["numpy"] = isinstance(arr, np.ndarray) and arr.view(np.float64).tolist() == list(
        range((comm.rank - 1) % comm.size + 3))
    return got


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_shift_hands_each_rank_the_previous_rank_bytes_whatever_their_sizes(n, transport):
    for rank, got in enumerate(run_world(n, _shift_sizes, transport=transport)):
        assert all(got.values()), f"rank {rank}: {got}"


def _shifts_both_ways(comm):
    """Backward shifts (the reverse ring, formed by the first) between forward ones and other
    collectives, with sizes that differ by rank; shift_into_ with the sizes known both sides."""
    got = {}
    n, me = comm.size, comm.rank
    nxt, prev = (me + 1) % n, (me - 1) % n
    size_of = lambda r: 0 if r == 1 else 100_003 * (r + 1)
    for round in range(3):
        mine = torch.full((size_of(me),), me + 1, dtype=torch.uint8)
        out = comm.shift(mine, backward=True)
        got[f"back {round}"] = out.numel() == size_of(nxt) and bool((out == nxt + 1).all())
        out = comm.shift(mine)
        got[f"forward {round}"] = out.numel() == size_of(prev) and bool((out == prev + 1).all())
        total = torch.tensor([float(me)])
        comm.allreduce_(total, elastic.Sum)
        got[f"allreduce {round}"] = total.item() == n * (n - 1) / 2
    for backward, sender in ((True, nxt), (False, prev)):
        mine = torch.arange(me * 10, me * 10 + 3 + me, dtype=torch.int64)
        out = torch.empty(3 + sender, dtype=torch.int64)
        comm.shift_into_(mine, out, backward=backward)
        got[f"into backward={backward}"] = out.tolist() == list(range(sender * 10, sender * 10 + 3 + sender))
    arr = np.empty(2, dtype=np.float32)
    comm.shift_into_(np.full(2, me, dtype=np.float32), arr, backward=True)
    got["numpy"] = arr.tolist() == [nxt, nxt]
    return got


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_a_backward_shift_hands_each_rank_the_next_rank_bytes(n, transport):
    for rank, got in enumerate(run_world(n, _shifts_both_ways, transport=transport)):
        assert got and all(got.values()), f"rank {rank}: {got}"


def test_a_backward_shift_works_in_a_mixed_world():
    # Hosts a, a, b, b: each link of the reverse ring settles shared memory or TCP by itself,
    # as the flat ring's do, so one ring has both.
    for rank, got in enumerate(run_world(4, _shifts_both_ways, transport=mixed_hosts(2, 2))):
        assert got and all(got.values()), f"rank {rank}: {got}"


def _misjudged_shift_into(comm, backward, expected, sent):
    # Rank 0 expects `expected` bytes from its sender (rank 1 backward, the last rank forward),
    # which sends `sent`; every other link agrees.
    sender = 1 if backward else comm.size - 1
    mine = torch.zeros(sent if comm.rank == sender else 16, dtype=torch.uint8)
    out = torch.empty(expected if comm.rank == 0 else 16, dtype=torch.uint8)
    try:
        comm.shift_into_(mine, out, backward=backward)
        comm.barrier()   # a sender done before its receiver refused learns it here
    except elastic.CollectiveMismatchError as e:
        return "mismatch", str(e)
    except elastic.WorkerLostError as e:
        return "lost", str(e)
    return "none", ""


@pytest.mark.parametrize("backward", [True, False])
@pytest.mark.parametrize("expected, sent", [(8, 4), (4, 8), (4096, 8192), (8192, 4096)])
def test_a_shift_of_another_size_than_the_receiver_expects_fails_as_a_mismatch(backward, expected, sent):
    # 4096-byte segments: a receiver expecting whole segments must not take a prefix of more.
    results = run_world(3, functools.partial(_misjudged_shift_into, backward=backward, expected=expected, sent=sent),
                        config=elastic.CommConfig(timeout=60, segment_bytes=4096))
    kind, text = results[0]
    sender = 1 if backward else 2
    assert kind == "mismatch" and f"rank {sender}" in text, results
    assert ("shift_back" if backward else "shift") in text, results
    assert [kind for kind, _ in results[1:]] == ["lost", "lost"], results


def _oversized_shift(comm):
    mine = torch.zeros(10_000 if comm.rank == 1 else 10, dtype=torch.uint8)
    try:
        comm.shift(mine, max_bytes=100)
        comm.barrier()   # a sender whose bytes fit in the socket's buffers learns it here
    except elastic.BadPeerError as e:
        return "bad peer", e.peer_rank
    except elastic.WorkerLostError as e:
        return "lost", e.peer_rank
    return "none", None


def test_a_shift_larger_than_the_receiver_takes_is_the_sender_failure():
    results = run_world(3, _oversized_shift)
    assert results[2] == ("bad peer", 1), results   # rank 2 receives from rank 1, which sends too much
    assert [kind for kind, _ in results[:2]] == ["lost", "lost"], results
