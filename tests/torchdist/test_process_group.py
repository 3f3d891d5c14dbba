"""elastic.process_group() as torch.distributed's default group, on real rings of forked ranks:
every op a user can reach gives torch's answer or a clear NotImplementedError, and a peer's
death raises WorkerLostError from the call (async_op=True too), never a silent wrong answer."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

import elastic
from elastic.runtime import current
from elastic.torchdist import group, group_collectives
from elastic.runtime import world
from elastic.runtime.worker_config import DEFAULT_GROUP_ENV
from tests.native.harness import TRANSPORTS, World, run_world


def _with_default_group(body, comm):
    world.use_ring(comm)
    try:
        assert group.install_default_group()
        return body(comm.rank, comm.size)
    finally:
        world.use_ring(None)


def _on_default_group(body):
    """A worker body that runs ``body(rank, size)`` with the elastic group as the default group
    (a partial of module-level functions, so it also starts under "spawn")."""
    return functools.partial(_with_default_group, body)


def _value(rank: int, n: int = 5, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) * (rank + 1) - rank).to(dtype)


def _ops(rank: int, size: int) -> dict:
    got = {}
    got["rank/size"] = (dist.get_rank(), dist.get_world_size(), dist.is_initialized(), dist.get_backend())
    every = [_value(r) for r in range(size)]
    for name, op, ref in [("sum", dist.ReduceOp.SUM, sum(every)), ("avg", dist.ReduceOp.AVG, sum(every) / size),
                          ("min", dist.ReduceOp.MIN, torch.stack(every).min(0).values),
                          ("max", dist.ReduceOp.MAX, torch.stack(every).max(0).values)]:
        t = _value(rank)
        dist.all_reduce(t, op=op)
        got[f"all_reduce {name}"] = torch.allclose(t, ref)
    for dtype in (torch.int8, torch.int16, torch.int64, torch.bfloat16, torch.float64):
        t = _value(rank, dtype=dtype)
        dist.all_reduce(t)
        got[f"all_reduce {dtype}"] = torch.equal(t, sum(_value(r, dtype=torch.float64) for r in range(size)).to(dtype))
    flags = torch.tensor([rank == 0, True, False])
    dist.all_reduce(flags, op=dist.ReduceOp.BOR)
    got["all_reduce bool BOR"] = flags.tolist() == [True, True, False]
    z = torch.complex(_value(rank), _value(rank) * 2)
    dist.all_reduce(z)
    got["all_reduce complex"] = torch.allclose(z, torch.complex(sum(every), sum(every) * 2))
    strided = torch.zeros(5, 2)[:, 0]
    strided.copy_(_value(rank))
    dist.all_reduce(strided)
    got["all_reduce non-contiguous"] = torch.allclose(strided, sum(every))
    w = dist.all_reduce(t := _value(rank), async_op=True)
    got["async wait"] = w.wait() is True and torch.allclose(t, sum(every)) and w.is_completed()

    for root in range(size):
        b = _value(rank)
        dist.broadcast(b, src=root)
        got[f"broadcast from {root}"] = torch.equal(b, _value(root))
    outs = [torch.empty(r + 1, dtype=torch.int64) for r in range(size)]
    dist.all_gather(outs, torch.full((rank + 1,), rank, dtype=torch.int64))
    got["all_gather uneven"] = [o.tolist() for o in outs] == [[r] * (r + 1) for r in range(size)]
    out = torch.empty(size * 5)
    dist.all_gather_into_tensor(out, _value(rank))
    got["all_gather_into_tensor"] = torch.equal(out, torch.cat(every))
    mine = torch.empty(5)
    dist.reduce_scatter(mine, [_value(rank) + j for j in range(size)])
    got["reduce_scatter"] = torch.allclose(mine, sum(every) + size * rank)
    mine = torch.empty(2)
    dist.reduce_scatter_tensor(mine, torch.arange(2.0 * size) * (rank + 1))
    got["reduce_scatter_tensor"] = torch.allclose(mine, torch.arange(2.0 * rank, 2.0 * rank + 2) *
                                                  (size * (size + 1) / 2))
    ins = [torch.tensor([rank * 10 + j]) for j in range(size)]
    outs = [torch.empty(1, dtype=torch.int64) for _ in range(size)]
    dist.all_to_all(outs, ins)
    got["all_to_all"] = [o.item() for o in outs] == [r * 10 + rank for r in range(size)]
    # Uneven splits: rank r sends j + 1 rows to rank j.
    send = torch.cat([torch.full((j + 1, 2), float(rank * 100 + j)) for j in range(size)])
    recv = torch.empty(size * (rank + 1), 2)
    dist.all_to_all_single(recv, send, output_split_sizes=[rank + 1] * size,
                           input_split_sizes=[j + 1 for j in range(size)])
    got["all_to_all_single uneven"] = torch.equal(
        recv, torch.cat([torch.full((rank + 1, 2), float(r * 100 + rank)) for r in range(size)]))
    gathered = [torch.empty(5) for _ in range(size)] if rank == 0 else None
    dist.gather(_value(rank), gathered, dst=0)
    got["gather"] = rank != 0 or all(torch.equal(g, e) for g, e in zip(gathered, every))
    piece = torch.empty(5)
    dist.scatter(piece, every if rank == size - 1 else None, src=size - 1)
    got["scatter"] = torch.equal(piece, every[rank])
    r = _value(rank)
    dist.reduce(r, dst=1)
    got["reduce"] = torch.allclose(r, sum(every)) if rank == 1 else torch.equal(r, _value(rank))
    dist.barrier()

    for name, call in [
        ("PRODUCT", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.PRODUCT)),
        ("send", lambda: dist.send(torch.ones(1), dst=(rank + 1) % size)),
        ("recv", lambda: dist.recv(torch.ones(1), src=(rank + 1) % size)),
        ("monitored_barrier", lambda: dist.monitored_barrier()),
        ("AVG", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.AVG)),
    ]:
        try:
            call()
            got[f"refuses {name}"] = "no error"
        except (NotImplementedError, ValueError) as e:   # ValueError: torch's own (monitored_barrier)
            got[f"refuses {name}"] = name.lower() in str(e).lower()
    return got


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_op_gives_torchs_answer_on_the_elastic_default_group(transport):
    size = 3
    for rank, got in enumerate(run_world(size, _on_default_group(_ops), transport=transport)):
        assert got.pop("rank/size") == (rank, size, True, "elastic")
        wrong = {k: v for k, v in got.items() if v is not True}
        assert not wrong, f"rank {rank}: {wrong}"


def _lose_a_peer(rank: int, size: int):
    dist.barrier()
    if rank == size - 1:
        os._exit(0)   # gone, mid-job, without a word
    caught = {}
    for name, call in [("all_reduce", lambda: dist.all_reduce(torch.ones(1 << 16))),
                       ("async all_reduce", lambda: dist.all_reduce(torch.ones(4), async_op=True).wait())]:
        try:
            call()
            caught[name] = "returned"
        except elastic.WorkerLostError as e:
            caught[name] = type(e).__name__
    caught["pending"] = type(current.session().noted_failure()).__name__
    return caught


def test_a_lost_peer_raises_worker_lost_from_dist_calls_never_silently():
    with World(3, _on_default_group(_lose_a_peer)) as world:
        world.wait_formed()
        for rank in (0, 1):
            msg = world.message(rank)
            assert msg[0] == "ok", msg
            assert msg[1] == {"all_reduce": "WorkerLostError", "async all_reduce": "WorkerLostError",
                              "pending": "WorkerLostError"}


@pytest.mark.parametrize("op,dtype,expected", [
    (dist.ReduceOp.SUM, torch.float32, elastic.Sum),
    (dist.ReduceOp.AVG, torch.bfloat16, elastic.Average),
    (dist.ReduceOp.MIN, torch.int64, elastic.Min),
    (dist.ReduceOp.MAX, torch.uint8, elastic.Max),
    (dist.ReduceOp.BOR, torch.bool, elastic.Max),
    (dist.ReduceOp.BAND, torch.bool, elastic.Min),
    (dist.ReduceOp.AVG, torch.int32, NotImplementedError),
    (dist.ReduceOp.PRODUCT, torch.float32, NotImplementedError),
    (dist.ReduceOp.BXOR, torch.int64, NotImplementedError),
    (dist.ReduceOp.BOR, torch.int64, NotImplementedError),
])
def test_reduce_op_table(op, dtype, expected):
    if expected is NotImplementedError:
        with pytest.raises(NotImplementedError, match="all_reduce"):
            group_collectives.ring_op(op, dtype, "all_reduce")
    else:
        assert group_collectives.ring_op(op, dtype, "all_reduce") == expected


def _script_owns_default_group(rank: int, size: int):
    # The script initialized torch.distributed itself (a one-process gloo group here):
    # elastic leaves it alone, and the elastic group is still there by name.
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        installed = group.install_default_group()
        return installed, dist.get_backend(), elastic.process_group().size()
    finally:
        dist.destroy_process_group()


def test_a_default_group_the_script_made_is_left_alone():
    assert run_world(2, _on_default_group(_script_owns_default_group)) == [(False, "gloo", 2)] * 2


def test_elastic_default_group_0_opts_out():
    def fn(comm):
        os.environ[DEFAULT_GROUP_ENV] = "0"
        world.use_ring(comm)
        return group.install_default_group(), dist.is_initialized()
    assert run_world(2, fn) == [(False, False)] * 2


def _rooted_ops_with_group_argument(rank: int, size: int):
    # Opted out of the default group: every call names the group, rooted ones too (torch looks
    # their ranks up in its tables).
    pg = elastic.process_group()
    got = {"is_initialized": dist.is_initialized()}
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=size - 1, group=pg)
    got["broadcast"] = b.item() == size - 1
    r = torch.tensor([rank + 1.0])
    dist.reduce(r, dst=0, group=pg)
    got["reduce"] = rank != 0 or r.item() == size * (size + 1) / 2
    outs = [torch.empty(1) for _ in range(size)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank)]), outs, dst=0, group=pg)
    got["gather"] = rank != 0 or [o.item() for o in outs] == [float(i) for i in range(size)]
    got["rank"] = (pg.rank(), pg.size()) == (rank, size)
    return got


def test_group_argument_works_for_rooted_ops_without_the_default_group():
    def fn(comm):
        os.environ[DEFAULT_GROUP_ENV] = "0"
        world.use_ring(comm)
        assert not group.install_default_group()
        return _rooted_ops_with_group_argument(comm.rank, comm.size)
    for got in run_world(3, fn):
        assert got == {"is_initialized": False, "broadcast": True, "reduce": True, "gather": True, "rank": True}


def _objects_and_subgroups(rank: int, size: int):
    import datetime
    got = {}
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank, "plain": [1, 2.5, "x", b"y", None, (True,)]})
    got["plain"] = objs == [{"rank": r, "plain": [1, 2.5, "x", b"y", None, (True,)]} for r in range(size)]
    # A class instance is what a pickle would construct on the receivers: the format carries none.
    # The first rank that cannot send names the type; every other rank names that rank.
    try:
        dist.all_gather_object(objs, datetime.date(2026, 12, 1))
        got["class"] = "sent"
    except TypeError as e:
        said = "a value of type datetime.date cannot be carried" if rank == 0 else "rank 0's object cannot be carried"
        got["class"] = said in str(e) or str(e)
    try:
        dist.new_group([0, 1])
        got["new_group"] = "made"
    except NotImplementedError as e:
        got["new_group"] = "new_group" in str(e)
    flags = torch.tensor([True, False])
    dist.all_reduce(flags)
    got["bool sum is or"] = flags.tolist() == [True, False]
    return got


def test_object_collectives_carry_plain_data_only_and_subgroups_are_refused():
    for got in run_world(2, _on_default_group(_objects_and_subgroups)):
        assert got == {"plain": True, "class": True, "new_group": True, "bool sum is or": True}


def _mismatched_split(rank: int, size: int):
    # Rank 0 expects one row from rank 1, which sends it two: every rank raises, none hangs.
    send = torch.arange(4.0).view(4, 1)
    out = torch.empty(4 if rank else 3, 1)
    splits_out = [2, 2] if rank else [2, 1]
    try:
        dist.all_to_all_single(out, send, output_split_sizes=splits_out, input_split_sizes=[2, 2])
        return "returned"
    except ValueError as e:
        return "rank 0 expects" in str(e) if rank == 0 else "rank(s) [0]" in str(e)


def test_all_to_all_with_split_sizes_that_disagree_raises_on_every_rank():
    assert run_world(2, _on_default_group(_mismatched_split), timeout=60) == [True, True]


def _compiled_ddp(rank: int, size: int):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = torch.compile(elastic.DistributedDataParallel(net), backend="aot_eager")
    grads = []
    for step in range(3):   # the second iteration rebuilds DDP's buckets, inside the compiled forward
        net.zero_grad()
        g = torch.Generator().manual_seed(step * 10 + rank)
        model(torch.randn(5, 4, generator=g)).sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]).tolist())
    return grads


@pytest.mark.slow
def test_torch_compile_of_a_ddp_model_trains_with_averaged_gradients():
    # Spawned: torch.compile's workers in a child forked from this test process (which by now
    # holds gRPC and etcd client threads from earlier tests) can wait forever on a lock a thread
    # of the parent held at the fork.
    a, b = run_world(2, _on_default_group(_compiled_ddp), timeout=240, start_method="spawn")
    assert a == b
