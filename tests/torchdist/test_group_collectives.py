"""The gathers and reduce-scatters FSDP2 calls, on the elastic group against torch's gloo in the
same processes: every dtype and op the group supports, uneven blocks, each torch form (tensor,
stack, list, coalesced, async), over TCP and shared memory; a peer's death mid-call raises
WorkerLostError from the call."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import elastic
from elastic.torchdist import group_collectives
from elastic.runtime import world
from elastic.runtime import current
from elastic.runtime.worker_config import DEFAULT_GROUP_ENV
from tests.native.harness import TRANSPORTS, World, run_world

R = dist.ReduceOp
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32]
# What gloo reduces itself (the others are compared with torch's arithmetic alone).
GLOO_REDUCES = set(FLOATS) | {torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64}
GLOO_GATHERS = GLOO_REDUCES
# Per-rank block sizes: empty, one element, odd, and one that spans several pipeline segments.
SIZES = [0, 1, 7, 3001]
SMALL_SEGMENTS = elastic.CommConfig(timeout=60, segment_bytes=4096)


def _ops_for(dtype):
    if dtype == torch.bool:
        return {"SUM": R.SUM, "MIN": R.MIN, "MAX": R.MAX, "BAND": R.BAND, "BOR": R.BOR}
    if dtype.is_complex:
        return {"SUM": R.SUM, "AVG": R.AVG}
    ops = {"SUM": R.SUM, "MIN": R.MIN, "MAX": R.MAX}
    if dtype.is_floating_point:
        ops["AVG"] = R.AVG
    return ops


def _data(rank: int, n: int, dtype, salt: int = 0) -> torch.Tensor:
    """Small integers (exact in every dtype, so sums are exact) that differ by rank and position."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_complex:
        return torch.complex(torch.randint(-3, 4, (n,), generator=g).float(),
                             torch.randint(-3, 4, (n,), generator=g).float()).to(dtype)
    low = 0 if dtype in (torch.uint8, torch.uint16, torch.uint32) else -3
    return torch.randint(low, 4, (n,), generator=g).to(dtype)


def _reduce(tensors, name: str, dtype) -> torch.Tensor:
    """torch's arithmetic on every rank's tensor: what the group must answer."""
    if dtype == torch.bool:
        stack = torch.stack(tensors)
        return stack.any(0) if name in ("SUM", "MAX", "BOR") else stack.all(0)
    wide = torch.stack([t.to(torch.complex128 if dtype.is_complex else torch.float64) for t in tensors])
    if name == "SUM":
        out = wide.sum(0)
    elif name == "AVG":
        out = wide.mean(0)
    elif name == "MIN":
        out = wide.min(0).values
    else:
        out = wide.max(0).values
    return out.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor, name: str) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if name == "AVG" or a.dtype in (torch.float16, torch.bfloat16):
        return torch.allclose(a.to(torch.complex128 if a.is_complex() else torch.float64),
                              b.to(torch.complex128 if b.is_complex() else torch.float64), rtol=1e-2, atol=1e-3)
    return torch.equal(a, b)


def _against_gloo(path: str):
    """A worker body: gloo is the default group (a file store), the elastic group is passed as
    ``group=``; every case is run on both and checked against torch's arithmetic."""
    def body(comm):
        rank, size = comm.rank, comm.size
        os.environ[DEFAULT_GROUP_ENV] = "0"
        world.use_ring(comm)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=size)
        pg = elastic.process_group()
        wrong = {}

        def check(case, got, want, name, gloo=None):
            if not _same(got, want, name):
                wrong[case] = f"elastic {got.tolist()[:6]} want {want.tolist()[:6]}"
            elif gloo is not None and not _same(got, gloo, name):
                wrong[case] = f"elastic {got.tolist()[:6]} gloo {gloo.tolist()[:6]}"

        try:
            for dtype in FLOATS + INTS + [torch.bool, torch.complex64]:
                for name, op in _ops_for(dtype).items():
                    for n in SIZES:
                        ins = [_data(r, n * size, dtype) for r in range(size)]
                        want = _reduce(ins, name, dtype)[rank * n:(rank + 1) * n]
                        outs = []
                        for group in (pg, None) if dtype in GLOO_REDUCES else (pg,):
                            out = torch.full((n,), 1).to(dtype)
                            dist.reduce_scatter_tensor(out, ins[rank].clone(), op=op, group=group)
                            outs.append(out)
                        check(("reduce_scatter_tensor", dtype, name, n), outs[0], want, name,
                              outs[1] if len(outs) > 1 else None)
                    # The list form, blocks of different sizes (rank j's block has 2j+1 elements).
                    counts = [2 * j + 1 for j in range(size)]
                    ins = [[_data(r, c, dtype, salt=j) for j, c in enumerate(counts)] for r in range(size)]
                    want = _reduce([ins[r][rank] for r in range(size)], name, dtype)
                    outs = []
                    for group in (pg, None) if dtype in GLOO_REDUCES else (pg,):
                        out = torch.zeros(counts[rank]).to(dtype)
                        dist.reduce_scatter(out, [t.clone() for t in ins[rank]], op=op, group=group)
                        outs.append(out)
                    check(("reduce_scatter uneven", dtype, name), outs[0], want, name,
                          outs[1] if len(outs) > 1 else None)
                for n in SIZES:   # gathers move bytes: every dtype, gloo's answer exactly
                    mine = _data(rank, n, dtype)
                    outs = []
                    for group in (pg, None) if dtype in GLOO_GATHERS else (pg,):
                        # The stack form on the elastic group (gloo takes only the concatenated one).
                        shape = (size, n) if group is pg else (size * n,)
                        out = torch.empty(shape, dtype=dtype)
                        dist.all_gather_into_tensor(out, mine, group=group)
                        outs.append(out.reshape(-1))
                    check(("all_gather_into_tensor", dtype, n), outs[0],
                          torch.cat([_data(r, n, dtype) for r in range(size)]), "gather",
                          outs[1] if len(outs) > 1 else None)
                # The list form with a different size per rank (gloo refuses that: torch's answer).
                outs = [torch.empty(r + 2, dtype=dtype) for r in range(size)]
                dist.all_gather(outs, _data(rank, rank + 2, dtype), group=pg)
                for r in range(size):
                    check(("all_gather uneven", dtype, r), outs[r], _data(r, r + 2, dtype), "gather")

            # The stack form of the reduce-scatter input, a non-contiguous output, async_op=True.
            ins = torch.arange(size * 2 * 3, dtype=torch.float32).view(size * 2, 3) * (rank + 1)
            out_e, out_g = torch.zeros(3, 4)[:, :2].t(), torch.zeros(2, 3)
            work = dist.reduce_scatter_tensor(out_e, ins, group=pg, async_op=True)
            wrong_work = work.wait() is not True or not work.is_completed()
            dist.reduce_scatter_tensor(out_g, ins)
            check(("reduce_scatter_tensor stack, strided output, async",), out_e.contiguous(), out_g, "SUM")
            if wrong_work:
                wrong["async work"] = "not finished"
            # Coalesced forms (torch's _coalescing_manager: one call for the lot).
            got = {}
            for group in (pg, None):
                outs_ag = [torch.empty(size * 5), torch.empty(size * 2, dtype=torch.int64)]
                outs_rs = [torch.empty(3), torch.empty(1, dtype=torch.float64)]
                with dist._coalescing_manager(group=group):
                    dist.all_gather_into_tensor(outs_ag[0], _data(rank, 5, torch.float32), group=group)
                    dist.all_gather_into_tensor(outs_ag[1], _data(rank, 2, torch.int64), group=group)
                with dist._coalescing_manager(group=group):
                    dist.reduce_scatter_tensor(outs_rs[0], _data(rank, 3 * size, torch.float32), group=group)
                    dist.reduce_scatter_tensor(outs_rs[1], _data(rank, size, torch.float64), group=group)
                got[group] = outs_ag + outs_rs
            for i, (e, g) in enumerate(zip(got[pg], got[None])):
                check(("coalesced", i), e, g, "SUM")
            # FSDP2's in-place all-gather: the input is this rank's slot of the output.
            out = torch.zeros(size * 4)
            out[rank * 4:(rank + 1) * 4] = rank + 1
            dist.all_gather_into_tensor(out, out[rank * 4:(rank + 1) * 4], group=pg)
            check(("in-place all_gather",), out, torch.arange(1.0, size + 1).repeat_interleave(4), "gather")

            refused = {}
            for what, call in [
                ("PRODUCT", lambda: dist.reduce_scatter_tensor(torch.ones(1), torch.ones(size), op=R.PRODUCT, group=pg)),
                ("AVG on int64", lambda: dist.reduce_scatter_tensor(torch.ones(1, dtype=torch.int64),
                                                                   torch.ones(size, dtype=torch.int64), op=R.AVG,
                                                                   group=pg)),
                ("BOR on int32", lambda: dist.reduce_scatter(torch.ones(1, dtype=torch.int32),
                                                            [torch.ones(1, dtype=torch.int32)] * size, op=R.BOR,
                                                            group=pg)),
                ("wrong size", lambda: dist.all_gather_into_tensor(torch.ones(size + 1), torch.ones(1), group=pg)),
            ]:
                try:
                    call()
                    refused[what] = "no error"
                except (NotImplementedError, ValueError) as e:
                    refused[what] = type(e).__name__ + (": names it" if what.split()[0].lower() in str(e).lower()
                                                        or "world size" in str(e) else f": {e}")
            dist.barrier(group=pg)   # every rank refused locally: the ring is still in step
            return wrong, refused
        finally:
            dist.destroy_process_group()
            world.use_ring(None)
    return body


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gathers_and_reduce_scatters_give_gloos_answers_for_every_dtype_op_and_size(transport, tmp_path):
    results = run_world(3, _against_gloo(str(tmp_path / "gloo-store")), transport=transport, config=SMALL_SEGMENTS,
                        timeout=240)
    for rank, (wrong, refused) in enumerate(results):
        assert not wrong, f"rank {rank}: {wrong}"
        assert refused == {"PRODUCT": "NotImplementedError: names it", "AVG on int64": "NotImplementedError: names it",
                           "BOR on int32": "NotImplementedError: names it", "wrong size": "ValueError: names it"}


def _moves_no_extra_copy(comm):
    # Contiguous tensors are handed to the ring as they are: the core reads and writes the
    # caller's memory (a list of chunks of one tensor counts as that tensor).
    seen = []
    for name in ("allgather_into_", "reduce_scatter_"):
        real = getattr(comm, name)

        def spy(out, inp, *rest, _real=real, _name=name):
            seen.append((_name, out.data_ptr(), inp.data_ptr()))
            return _real(out, inp, *rest)
        setattr(comm, name, spy)
    run = lambda fn, *a: fn(*a)   # noqa: E731
    n = comm.size
    out, inp = torch.empty(n * 3), torch.ones(3)
    group_collectives.all_gather_into_tensor(comm, run, out, inp)
    pieces = torch.empty(n * 3).chunk(n)
    group_collectives.all_gather_list(comm, run, list(pieces), inp)
    rs_out, rs_in = torch.empty(3), torch.ones(n * 3)
    group_collectives.reduce_scatter_tensor(comm, run, rs_out, rs_in, dist.ReduceOp.SUM)
    group_collectives.reduce_scatter_list(comm, run, rs_out, list(rs_in.chunk(n)), dist.ReduceOp.SUM)
    return seen == [("allgather_into_", out.data_ptr(), inp.data_ptr()),
                    ("allgather_into_", pieces[0].data_ptr(), inp.data_ptr()),
                    ("reduce_scatter_", rs_out.data_ptr(), rs_in.data_ptr()),
                    ("reduce_scatter_", rs_out.data_ptr(), rs_in.data_ptr())]


def test_contiguous_tensors_go_to_the_ring_as_they_are():
    assert run_world(2, _moves_no_extra_copy) == [True, True]


def _lose_a_peer_mid_fsdp_call(comm):
    world.use_ring(comm)
    pg = elastic.process_group()
    dist.barrier(group=pg)
    if comm.rank == comm.size - 1:
        os._exit(0)
    caught = {}
    for name, call in [
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(1 << 18), torch.ones(comm.size << 18),
                                                                     group=pg, async_op=True)),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(comm.size << 18),
                                                                       torch.ones(1 << 18), group=pg,
                                                                       async_op=True).wait()),
    ]:
        try:
            call()
            caught[name] = "returned"
        except elastic.WorkerLostError as e:
            caught[name] = type(e).__name__
    caught["pending"] = type(current.session().noted_failure()).__name__
    return caught


def test_a_lost_peer_raises_worker_lost_from_fsdp_collectives_with_async_op():
    with World(3, _lose_a_peer_mid_fsdp_call) as world:
        world.wait_formed()
        for rank in (0, 1):
            msg = world.message(rank)
            assert msg[0] == "ok", msg
            assert msg[1] == {"reduce_scatter_tensor": "WorkerLostError", "all_gather_into_tensor": "WorkerLostError",
                              "pending": "WorkerLostError"}
