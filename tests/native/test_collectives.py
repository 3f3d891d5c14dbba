"""Collectives give numpy's answer, bit-identical on every rank, for every dtype, op and size."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import elastic

from .cases import DTYPES, OPS, digest, make_input, reference
from .harness import TRANSPORTS, run_world

SIZES = [0, 1, 7, 1001, 70_001, 400_009]
WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
# Default settings, and a ring forced onto even tiny buffers with many short segments
# (blocks smaller than one element per rank, segments that straddle blocks).
CONFIGS = {
    "default": elastic.CommConfig(timeout=60),
    "ring-only": elastic.CommConfig(timeout=60, small_bytes=0, segment_bytes=4096),
}


def _cases():
    """Every case of the matrix: (dtype, op, count, the key that names it)."""
    for dtype in DTYPES:
        for op in OPS:
            for count in SIZES:
                yield dtype, op, count, f"{dtype}/{op.name}/{count}"


@functools.lru_cache(maxsize=None)
def numpy_answers(n: int) -> dict:
    """numpy's answer to every case of the matrix for a world of ``n`` (its dtype and SHA-256),
    worked out once per world size: four worlds of each size (two settings, two transports)
    check against it, and no rank spends its time on it."""
    answers = {}
    for dtype, op, count, key in _cases():
        want = reference([make_input(r, dtype, count, op) for r in range(n)], dtype, op)
        answers[key] = (str(want.dtype), digest(want))
    return answers


def _matrix(answers, comm):
    # Every rank checks its result against numpy's, so every rank holds numpy's bits.
    failures = []
    for dtype, op, count, key in _cases():
        t = make_input(comm.rank, dtype, count, op)
        comm.allreduce_(t, op)
        if (str(t.dtype), digest(t)) != answers[key]:
            failures.append(key)
    return failures


def check_matrix_on_every_rank(n: int, **world) -> None:
    """Runs the matrix on a world of ``n`` (``world``: run_world's settings) and fails naming
    every rank whose result differs from numpy's (and so from any other rank's)."""
    results = run_world(n, functools.partial(_matrix, numpy_answers(n)), timeout=240, **world)
    assert len(results) == n
    for rank, failures in enumerate(results):
        assert failures == [], f"rank {rank} differs from numpy for {failures}"


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_allreduce_matches_numpy_bitwise_on_every_rank(n, config, transport):
    check_matrix_on_every_rank(n, config=CONFIGS[config], transport=transport)


def _random_floats(comm):
    out = {}
    for dtype in ["float16", "bfloat16", "float32", "float64"]:
        for count in [5, 100_003]:
            t = make_input(comm.rank, dtype, count, elastic.Sum, exact=False)
            inputs = [make_input(r, dtype, count, elastic.Sum, exact=False) for r in range(comm.size)]
            comm.allreduce_(t, elastic.Average)
            want = torch.stack([x.to(torch.float64) for x in inputs]).mean(0)
            tol = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 1e-6, "float64": 1e-12}[dtype]
            assert torch.allclose(t.to(torch.float64), want, atol=tol, rtol=tol), dtype
            out[f"{dtype}/{count}"] = digest(t)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [3, 5])
def test_allreduce_of_arbitrary_floats_is_identical_on_every_rank(n, transport):
    # With non-integer values the summation order matters; every rank must still hold the same bits.
    results = run_world(n, _random_floats, transport=transport)
    assert all(r == results[0] for r in results)


def _one_gib(comm):
    t = np.full(1 << 28, comm.rank + 1, dtype=np.float32)  # 1 GiB
    comm.allreduce_(t, elastic.Sum)
    expect = sum(range(1, comm.size + 1))
    return bool((t == expect).all()), digest(torch.from_numpy(t[:1 << 20]))


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_allreduce_of_one_gib(transport):
    results = run_world(2, _one_gib, config=elastic.CommConfig(timeout=120), timeout=300, transport=transport)
    assert all(ok for ok, _ in results)
    assert results[0][1] == results[1][1]


def _broadcast_every_root(comm):
    seen = []
    for root in range(comm.size):
        for count in [0, 1, 3_000_001]:
            t = torch.full((count,), float(comm.rank), dtype=torch.float32)
            comm.broadcast_(t, root_rank=root)
            seen.append(bool((t == root).all()))
        arr = np.arange(17, dtype=np.int64) * (comm.rank + 1)
        comm.broadcast_(arr, root_rank=root)
        seen.append(bool((arr == np.arange(17) * (root + 1)).all()))
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_broadcast_from_every_root(n, transport):
    for seen in run_world(n, _broadcast_every_root, transport=transport):
        assert all(seen)


def _allgather_ragged(comm):
    rows = [3, 0, 5, 1, 2, 7, 4, 6][comm.rank]
    t = torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) + 100 * comm.rank
    out = comm.allgather(t)
    want = torch.cat([torch.arange([3, 0, 5, 1, 2, 7, 4, 6][r] * 3, dtype=torch.float64).reshape(-1, 3) + 100 * r
                      for r in range(comm.size)])
    big = np.full(1_500_000 + comm.rank, comm.rank, dtype=np.uint8)
    big_out = comm.allgather(big)
    big_want = np.concatenate([np.full(1_500_000 + r, r, dtype=np.uint8) for r in range(comm.size)])
    return torch.equal(out, want), bool(np.array_equal(big_out, big_want)), tuple(out.shape)


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_allgather_with_different_first_dimensions(n, transport):
    for same, same_big, shape in run_world(n, _allgather_ragged, transport=transport):
        assert same and same_big
        assert shape == (sum([3, 0, 5, 1, 2, 7, 4, 6][:n]), 3)


def _allgather_bad_shape(comm):
    t = torch.zeros(2, 3 if comm.rank == 0 else 4)
    try:
        comm.allgather(t)
    except ValueError as e:
        return str(e)
    return None


def test_allgather_rejects_different_trailing_shapes_with_a_clear_error():
    for msg in run_world(2, _allgather_bad_shape):
        assert msg is not None and "trailing shape" in msg


def _barrier_and_object(comm):
    comm.barrier()
    obj = comm.broadcast_object({"rank": comm.rank, "payload": list(range(1000))} if comm.rank == 1 else None,
                                root_rank=1)
    comm.barrier()
    return obj


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_barrier_and_broadcast_object(transport):
    for obj in run_world(3, _barrier_and_object, transport=transport):
        assert obj == {"rank": 1, "payload": list(range(1000))}


def _async_fusion(comm):
    grads = [torch.full((1000 + i,), float(comm.rank + i)) for i in range(10)]
    before = comm.ops_run
    handles = [comm.allreduce_async_(g, elastic.Sum) for g in grads]
    for h in handles:
        comm.synchronize(h)
    fused_ops = comm.ops_run - before
    ok = all(torch.all(g == sum(r + i for r in range(comm.size))) for i, g in enumerate(grads))
    # A bucket closes when the next tensor would pass the threshold: 3 tensors of ~4 KiB fit in 12 KiB.
    return ok, fused_ops


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_async_allreduces_are_fused_into_one_collective(transport):
    for ok, fused_ops in run_world(3, _async_fusion, transport=transport):
        assert ok
        assert fused_ops == 1


def test_fusion_threshold_splits_buckets_deterministically():
    results = run_world(3, _async_fusion, config=elastic.CommConfig(fusion_bytes=12_500))
    for ok, fused_ops in results:
        assert ok
        assert fused_ops == 4  # 10 tensors of 4-4.04 KB, at most 3 per 12.5 KB bucket


def _zero_copy(comm):
    t = torch.ones(1_000_000, dtype=torch.bfloat16, requires_grad=True)
    ptr = t.data_ptr()
    with torch.no_grad():
        comm.allreduce_(t, elastic.Sum)
    arr = np.ones(1000, dtype=np.float16)
    comm.allreduce_(arr, elastic.Max)
    new = comm.allreduce(torch.ones(4), elastic.Sum)
    return t.data_ptr() == ptr, float(t[0]), arr.dtype.name, float(new[0])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_torch_tensors_and_numpy_arrays_are_reduced_in_place(transport):
    for same_ptr, value, dtype, new in run_world(2, _zero_copy, transport=transport):
        assert same_ptr and value == 2.0 and dtype == "float16" and new == 2.0


def _bad_inputs(comm):
    errors = []
    for bad in [torch.zeros(4, 4).t(), np.zeros(3, dtype=np.complex64), torch.zeros(3, dtype=torch.bool), [1, 2, 3]]:
        try:
            comm.allreduce_(bad, elastic.Sum)
            errors.append(None)
        except (TypeError, ValueError) as e:
            errors.append(type(e).__name__ + ": " + str(e))
    try:
        comm.broadcast_(torch.zeros(3), root_rank=comm.size)
        errors.append(None)
    except ValueError as e:
        errors.append(str(e))
    # Bad input leaves the communicator usable.
    t = torch.ones(3)
    comm.allreduce_(t, elastic.Sum)
    return errors, float(t[0])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_inputs_get_clear_errors_and_leave_the_ring_usable(transport):
    for errors, value in run_world(2, _bad_inputs, transport=transport):
        assert None not in errors, errors
        assert "contiguous" in errors[0]
        assert "dtype" in errors[1] and "dtype" in errors[2]
        assert "torch.Tensor or numpy.ndarray" in errors[3]
        assert "root rank" in errors[4]
        assert value == 2.0


def test_world_of_one_needs_no_listener():
    comm = elastic.Communicator.form(listener=None, job_id="solo", secret=b"s", world_version=0, rank=0,
                                     peers=["127.0.0.1:1"])
    try:
        t = torch.arange(5, dtype=torch.float32)
        comm.allreduce_(t, elastic.Average)
        assert torch.equal(t, torch.arange(5, dtype=torch.float32))
        assert torch.equal(comm.allgather(torch.ones(2, 2)), torch.ones(2, 2))
        assert comm.broadcast_object("x") == "x"
        comm.barrier()
    finally:
        comm.close()
