"""elastic.device_mesh() and FSDP2/DTensor on the elastic default group, on real rings of forked
ranks: FSDP2 trains as one process would on the global batches, DTensor's collectives and
torch.distributed.checkpoint's state-dict APIs work, and a mesh of a world that is over raises
StaleMeshError instead of running on the next one."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import elastic
from elastic.runtime import current
from elastic.torchdist import group
from elastic.runtime import world
from tests.native.harness import World, run_world

from .fsdp_job import batch, build, optimizer, reference, shard, train_step

STEPS = 4


def _on_default_group(body):
    def fn(comm):
        torch.manual_seed(1234)   # the same on every rank, as a script's seeding would make it
        world.use_ring(comm)
        try:
            assert group.install_default_group()
            return body(comm)
        finally:
            world.use_ring(None)
    return fn


def _close(got: dict, want: dict) -> dict:
    """{name: max abs difference} for the tensors that differ beyond float tolerance."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return {k: (got[k].double() - want[k].double()).abs().max().item() for k in want
            if not torch.allclose(got[k].double(), want[k].double(), rtol=1e-4, atol=1e-6)}


def _fsdp2_and_dtensor(comm):
    rank, size = comm.rank, comm.size
    got = {}
    mesh = elastic.device_mesh()
    pg = mesh.get_group()
    got["mesh"] = (mesh.size(), mesh.get_local_rank(), pg.rank(), pg.size(), elastic.device_mesh() is mesh)
    # However a mesh is made on the elastic default group, it holds this world's group.
    got["same group"] = (DeviceMesh.from_group(elastic.process_group(), "cpu").get_group() is pg
                         and init_device_mesh("cpu", (size,)).get_group() is pg
                         and pg.group_name == elastic.process_group().group_name == f"elastic/world{comm.world_version}")

    model = build()
    shard(model, mesh)
    opt = optimizer(model)
    want_steps, want_opt = reference(size, STEPS)
    for step in range(STEPS):
        train_step(model, opt, *batch(step, rank))
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        got[f"step {step}"] = _close(full, want_steps[step])
    # FSDP2's explicit prefetch: an async all-gather whose Work is waited on later.
    handle = model[0].unshard(async_op=True)
    handle.wait()
    got["unshard(async_op=True)"] = _close({"w": model[0].weight.detach()}, {"w": want_steps[-1]["0.weight"]})
    model[0].reshard()
    options = StateDictOptions(full_state_dict=True)
    got["get_model_state_dict"] = _close(get_model_state_dict(model, options=options), want_steps[-1])
    osd = get_optimizer_state_dict(model, opt, options=options)
    names = list(want_steps[-1])
    got["get_optimizer_state_dict"] = {
        (name, key): diff for i, name in enumerate(names) for key in ("exp_avg", "exp_avg_sq")
        for diff in [_close({0: osd["state"][name][key]}, {0: want_opt["state"][i][key]})] if diff}

    # DTensor's own collectives (functional collectives, by group name) on the world's group.
    whole = torch.arange(size * 5 * 3, dtype=torch.float32).view(size * 5, 3)
    d = distribute_tensor(whole, mesh, [Shard(0)])
    got["redistribute"] = torch.equal(d.redistribute(mesh, [Replicate()]).to_local(), whole)
    odd = torch.arange(4 * 7, dtype=torch.float64).view(4, 7)
    got["uneven Shard(1) full_tensor"] = torch.equal(distribute_tensor(odd, mesh, [Shard(1)]).full_tensor(), odd)
    partial = DTensor.from_local(torch.full((2,), float(rank + 1)), mesh, [Partial()])
    got["Partial sum"] = partial.full_tensor().tolist() == [size * (size + 1) / 2] * 2
    gathered = funcol.all_gather_tensor(torch.full((2,), float(rank)), 0, pg)
    got["funcol all_gather"] = gathered.tolist() == [float(r) for r in range(size) for _ in range(2)]
    scattered = funcol.reduce_scatter_tensor(torch.arange(2.0 * size), "sum", 0, pg)
    got["funcol reduce_scatter"] = scattered.tolist() == [size * (2.0 * rank), size * (2.0 * rank + 1)]
    return got


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_fsdp2_on_the_elastic_mesh_trains_as_one_process_on_the_global_batches(size):
    for rank, got in enumerate(run_world(size, _on_default_group(_fsdp2_and_dtensor), timeout=240)):
        assert got.pop("mesh") == (size, rank, rank, size, True)
        assert got.pop("same group") is True
        differ = {k: v for k, v in got.items() if v not in ({}, True)}
        assert not differ, f"rank {rank}: {differ}"


def _next_world_reversed(comm):
    """A world of the same workers with the ranks reversed (version 2), formed by hand."""
    addresses = comm.allgather(np.frombuffer(comm.listener.address.encode().ljust(64), dtype=np.uint8).copy())
    peers = [bytes(addresses[i * 64:(i + 1) * 64]).decode().strip() for i in range(comm.size)][::-1]
    return elastic.Communicator.form(listener=comm.listener, job_id="test-job", secret=b"test-secret",
                                     world_version=2, rank=comm.size - 1 - comm.rank, peers=peers,
                                     config=elastic.CommConfig(timeout=60))


def _stale_mesh(comm):
    got = {}
    old_mesh = elastic.device_mesh()
    old_view = old_mesh.get_group()
    x, y = batch(0, comm.rank)
    models = {}
    for how, mesh in [("device_mesh", old_mesh), ("from_group", DeviceMesh.from_group(elastic.process_group(), "cpu"))]:
        models[how] = build()
        shard(models[how], mesh)
        train_step(models[how], optimizer(models[how]), x, y)
    old_name = elastic.process_group().group_name

    new = _next_world_reversed(comm)   # a world of the same size: the meshes compare equal in torch
    world.use_ring(new)
    try:
        for what, call in [("FSDP2 forward", lambda: models["device_mesh"](x)),
                           ("from_group FSDP2 forward", lambda: models["from_group"](x)),
                           ("DTensor full_tensor",
                            lambda: next(iter(models["device_mesh"].state_dict().values())).full_tensor()),
                           ("old view", lambda: dist.barrier(group=old_view))]:
            try:
                call()
                got[what] = "ran in the new world"
            except elastic.StaleMeshError as e:
                got[what] = ("elastic.device_mesh()" in str(e), e.world_version, e.current_world_version)
        mesh = elastic.device_mesh()
        got["new mesh"] = (mesh != old_mesh, mesh.get_local_rank(), elastic.process_group().group_name != old_name)
        # Rebuilt in the new world, either way, they train (DTensor's caches do not hand them the old mesh).
        for how, mesh in [("device_mesh", mesh), ("from_group", DeviceMesh.from_group(elastic.process_group(), "cpu"))]:
            fresh = build()
            shard(fresh, mesh)
            train_step(fresh, optimizer(fresh), x, y)
            got[f"rebuilt on {how} trains"] = True
        got["pending failure"] = current.session().noted_failure()
    finally:
        world.use_ring(comm)
        new.close()
    return got


@pytest.mark.slow
def test_a_mesh_of_a_world_that_is_over_raises_stale_mesh_error_and_a_rebuilt_model_trains():
    for rank, got in enumerate(run_world(2, _on_default_group(_stale_mesh), timeout=240)):
        for what in ("FSDP2 forward", "from_group FSDP2 forward", "DTensor full_tensor", "old view"):
            assert got.pop(what) == (True, 1, 2), f"rank {rank}: {what}"
        assert got == {"new mesh": (True, 1 - rank, True), "rebuilt on device_mesh trains": True,
                       "rebuilt on from_group trains": True, "pending failure": None}


def _lose_a_peer_in_backward(comm):
    model = build()
    shard(model, elastic.device_mesh())
    opt = optimizer(model)
    x, y = batch(0, comm.rank)
    train_step(model, opt, x, y)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if comm.rank == comm.size - 1:
        os._exit(0)   # gone between forward and backward, without a word
    try:
        loss.backward()   # FSDP2's reduce-scatters run in backward's hooks
        raised = "nothing"
    except Exception as e:  # noqa: BLE001 (what autograd hands back is the point)
        raised = type(e).__name__
    return raised, type(current.session().noted_failure()).__name__


@pytest.mark.slow
def test_a_peer_lost_in_fsdp2_backward_is_the_rings_worker_lost_error():
    with World(3, _on_default_group(_lose_a_peer_in_backward)) as world:
        world.wait_formed()
        for rank in (0, 1):
            msg = world.message(rank, timeout=120)
            assert msg[0] == "ok", msg
            # elastic.run raises the recorded failure for whatever torch made of it.
            assert msg[1] == ("WorkerLostError", "WorkerLostError"), msg[1]


def test_device_mesh_needs_a_world_and_has_one_dimension():
    with pytest.raises(elastic.RendezvousError, match="no ring"):
        elastic.device_mesh()
    with pytest.raises(ValueError, match="one dimension"):
        elastic.device_mesh(("dp", "tp"))
