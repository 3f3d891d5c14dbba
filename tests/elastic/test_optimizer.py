"""DistributedOptimizer and the broadcast helpers on real rings (forked ranks, explicit peers)."""

from __future__ import annotations

import pytest
import torch

import elastic
from elastic.runtime import collectives

from ..native.harness import run_world


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))


def _batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)


def _train_steps(comm):
    collectives.set_communicator(comm)
    model = _model()
    # Tiny buckets: several buckets launched during backward, in order.
    opt = elastic.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), bucket_bytes=1024)
    for _ in range(3):
        opt.zero_grad()
        x, y = _batch(comm.rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    # The reference runs here, in a worker: autograd in the pytest process would make every
    # later forked worker hang in backward().
    ref = [p.numpy().copy() for p in _reference(comm.size)] if comm.rank == 0 else None
    # numpy, not tensors: tensors cross a pipe as shared memory that dies with the worker
    return [p.detach().numpy().copy() for p in model.parameters()], len(opt._elastic_buckets), ref


def _reference(size):
    """The same 3 steps in one process, averaging the ranks' gradients by hand."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        grads = []
        for r in range(size):
            model.zero_grad()
            x, y = _batch(r)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.slow
def test_distributed_optimizer_averages_gradients_over_the_world():
    results = run_world(3, _train_steps, start_method="forkserver")
    want = results[0][2]
    for params, buckets, _ in results:
        assert buckets > 1
        for got, exp in zip(params, want):
            assert torch.allclose(torch.from_numpy(got), torch.from_numpy(exp), atol=1e-6)
    for params, _, _ in results[1:]:
        assert all((a == b).all() for a, b in zip(params, results[0][0]))


def _unused_parameter(comm):
    collectives.set_communicator(comm)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 1), "unused": torch.nn.Linear(4, 1)})
    opt = elastic.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
    before = model["unused"].weight.detach().clone()
    opt.zero_grad()
    model["used"](torch.ones(2, 4) * (comm.rank + 1)).sum().backward()
    opt.step()  # the unused parameter contributes zeros; nobody waits forever
    return torch.equal(model["unused"].weight, before), float(model["used"].bias)


@pytest.mark.slow
def test_a_parameter_without_gradient_does_not_hang_the_step():
    results = run_world(2, _unused_parameter, start_method="forkserver")
    assert all(unchanged for unchanged, _ in results)
    assert results[0][1] == results[1][1]


def _broadcasts(comm):
    collectives.set_communicator(comm)
    model = _model(seed=comm.rank)  # different on every rank
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (comm.rank + 1))
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    elastic.broadcast_parameters(model.state_dict(), root_rank=1)
    elastic.broadcast_optimizer_state(opt, root_rank=1)
    return ([p.detach().numpy().copy() for p in model.parameters()], opt.param_groups[0]["lr"],
            opt.state_dict()["state"][0]["exp_avg"].numpy().copy())


@pytest.mark.slow
def test_broadcast_parameters_and_optimizer_state_from_any_root():
    results = run_world(3, _broadcasts, start_method="forkserver")
    for params, lr, exp_avg in results:
        assert lr == 0.02
        assert all((a == b).all() for a, b in zip(params, results[1][0]))
        assert (exp_avg == results[1][2]).all()


def test_object_state_commit_restore_copies_not_references():
    state = elastic.ObjectState(epoch=1, history=[1, 2])
    state._snapshot = state.save()  # commit without a ring: the copy alone
    state.epoch = 5
    state.history.append(3)
    state.restore()
    assert state.epoch == 1 and state.history == [1, 2]
    state.history.append(9)
    state.restore()
    assert state.history == [1, 2], "restore must not hand out the snapshot itself"


def _accumulate(comm):
    collectives.set_communicator(comm)
    model = _model()
    opt = elastic.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_bytes=1024,
                                       backward_passes_per_step=2)
    opt.zero_grad()
    for micro in range(2):
        x, y = _batch(comm.rank * 2 + micro)
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    # Without backward_passes_per_step, a second pass is refused instead of silently diverging.
    plain = elastic.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1))
    m2 = _model()
    plain = elastic.DistributedOptimizer(torch.optim.SGD(m2.parameters(), lr=0.1))
    error = ""
    try:
        for micro in range(2):
            x, y = _batch(micro)
            torch.nn.functional.mse_loss(m2(x), y).backward()
    except RuntimeError as e:
        error = str(e)
    plain.zero_grad()
    ref = None
    if comm.rank == 0:
        m = _model()
        grads = []
        for r in range(comm.size):
            m.zero_grad()
            for micro in range(2):
                x, y = _batch(r * 2 + micro)
                torch.nn.functional.mse_loss(m(x), y).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        with torch.no_grad():
            for i, p in enumerate(m.parameters()):
                p -= 0.1 * torch.stack([g[i] for g in grads]).mean(0)
        ref = [p.detach().numpy().copy() for p in m.parameters()]
    return [p.detach().numpy().copy() for p in model.parameters()], ref, error


@pytest.mark.slow
def test_gradient_accumulation_over_several_backward_passes():
    results = run_world(2, _accumulate, start_method="forkserver")
    ref = results[0][1]
    for params, _, error in results:
        for got, exp in zip(params, ref):
            assert abs(got - exp).max() < 1e-6
        assert "backward_passes_per_step" in error


def _late_group(comm):
    collectives.set_communicator(comm)
    torch.manual_seed(0)  # the same initial weights on every rank
    body, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    opt = elastic.DistributedOptimizer(torch.optim.SGD(body.parameters(), lr=0.1))
    opt.add_param_group({"params": head.parameters()})
    opt.zero_grad()
    head(body(torch.ones(2, 4) * (comm.rank + 1))).sum().backward()
    opt.step()
    return head.weight.detach().numpy().copy()


@pytest.mark.slow
def test_parameters_added_later_are_averaged_too():
    a, b = run_world(2, _late_group, start_method="forkserver")
    assert (a == b).all()
