"""Where a step stands, and which failures keep the live state: table tests of elastic.runtime.step_phase,
the sync root's choice, and a real TorchState (torch model, optimizer and ElasticSampler, no
ring) following its steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import elastic
from elastic.state.sync import holders, most_advanced, synced_step
from elastic.runtime.step_phase import Event, Phase, advance, completes_a_step, harmless

B, U, S, R, X = Phase.BOUNDARY, Phase.UPDATING, Phase.STEPPED, Phase.RECORDED, Phase.UNPAIRED
FWD, BEGINS, ENDS, REC, SETTLED = Event.FORWARD, Event.UPDATE_BEGINS, Event.UPDATE_ENDS, Event.BATCH_RECORDED, \
    Event.SETTLED


def run(events, records_batches=True, phase=B):
    seen = []
    for e in events:
        phase = advance(phase, e, records_batches)
        seen.append(phase)
    return seen


@pytest.mark.parametrize("events, records_batches, phases", [
    # The contract's loop: forward, backward, step, record; complete at the next step's forward.
    ([FWD, BEGINS, ENDS, REC, FWD], True, [B, U, S, R, B]),
    ([FWD, BEGINS, ENDS, REC, FWD, BEGINS, ENDS, REC, FWD], True, [B, U, S, R, B, U, S, R, B]),
    # No sampler: complete at the next forward (the loop's bookkeeping after step() ran by then).
    ([FWD, BEGINS, ENDS, FWD], False, [B, U, S, B]),
    # Micro-batches (forwards) before one step, recorded once: fine.
    ([FWD, FWD, FWD, BEGINS, ENDS, REC, FWD], True, [B, B, B, U, S, R, B]),
    # An optimizer subclass calling its base's step(): hooks nested, one update.
    ([FWD, BEGINS, BEGINS, ENDS, ENDS, REC, FWD], True, [B, U, U, S, S, R, B]),
    # Recorded before its step (each micro-batch, or record-then-step): unpaired for good.
    ([FWD, REC, BEGINS, ENDS, REC, FWD], True, [B, X, X, X, X, X]),
    ([REC, FWD, BEGINS, ENDS, FWD], True, [X, X, X, X, X]),
    # A step whose batch is never recorded, while a sampler is held.
    ([FWD, BEGINS, ENDS, FWD], True, [B, U, S, X]),
    # Two updates in one step (a second optimizer), or a forward inside step() (LBFGS).
    ([FWD, BEGINS, ENDS, BEGINS, ENDS, REC], True, [B, U, S, X, X, X]),
    ([FWD, BEGINS, FWD, ENDS], False, [B, U, X, X]),
    # A commit, sync, restore or kept state settles wherever the step stood, unpaired too.
    ([BEGINS, SETTLED], True, [U, B]),
    ([REC, SETTLED, FWD], True, [X, B, B]),
])
def test_a_step_is_complete_once_updated_recorded_and_the_next_forward_began(events, records_batches, phases):
    assert run(events, records_batches) == phases


@pytest.mark.parametrize("phase, kept", [(B, True), (U, False), (S, False), (R, False), (X, False)])
def test_only_a_failure_at_a_step_boundary_keeps_the_live_state(phase, kept):
    # Inside step() parameters may be half updated; after it, until the next forward, the
    # step's bookkeeping (its record, state.step += 1) may not have run: keeping would train
    # its samples again. Unpaired events prove nothing.
    assert harmless(phase) is kept


@pytest.mark.parametrize("before, after, completes", [
    (R, B, True), (S, B, True), (B, B, False), (U, S, False), (S, R, False), (X, B, False),
])
def test_a_step_counts_as_progress_when_the_next_forward_begins(before, after, completes):
    assert completes_a_step(before, after) is completes


def test_an_unknown_event_is_refused():
    with pytest.raises(ValueError, match="not a step event"):
        advance(B, "update_begins", True)


@pytest.mark.parametrize("positions, root, step", [
    ([[3, 0], [3, 2], [3, 2]], 1, 4),      # two survivors stepped once more: the lowest of them, a new commit
    ([[4, 0], [3, 5]], 0, 4),              # a newer commit beats steps kept past an older one
    ([[-1, 0], [-1, 0]], 0, -1),           # nobody committed: rank 0 (or the durable commit)
    ([[2, 1], [2, 0], [2, 1]], 0, 3),
    ([[5, 0], [5, 0], [5, 0]], 0, 5),      # all restored (or kept nothing past the commit)
])
def test_the_sync_root_is_the_most_advanced_and_a_state_kept_past_its_commit_is_a_new_commit(positions, root,
                                                                                              step):
    got = most_advanced(np.array(positions, dtype=np.int64))
    assert got == root
    assert synced_step(*positions[got]) == step


@pytest.mark.parametrize("rows, root, held", [
    # Survivors that kept the same steps past the same commit, with the same bits: nothing travels.
    ([[3, 2, 900, 77], [3, 2, 900, 77], [3, 2, 900, 77]], 0, (0, 1, 2)),
    # A newcomer (no commit, no digest) joins two members that hold the state.
    ([[3, 0, 900, 77], [-1, 0, -1, -1], [3, 0, 900, 77]], 0, (0, 2)),
    # The same position, other bits (a replica that drifted, a restored rank): it loads.
    ([[3, 2, 900, 77], [3, 2, 900, 78], [3, 2, 901, 77]], 0, (0,)),
    # A rank one step behind holds an older state, whatever its digest.
    ([[3, 1, 900, 77], [3, 2, 900, 77]], 1, (1,)),
    # The root has no commit (the first sync, perhaps from a durable commit) or no digest.
    ([[-1, 0, -1, -1], [-1, 0, -1, -1]], 0, ()),
    ([[3, 0, -1, -1], [3, 0, -1, -1]], 0, ()),
    # The root's digest at another position proves nothing; lower ranks that hold an older state.
    ([[3, 1, 900, 77], [3, 2, 900, 77], [2, 0, 900, 77], [3, 2, 900, 77]], 1, (1, 3)),
])
def test_the_ranks_that_hold_the_roots_state_share_its_position_and_digest(rows, root, held):
    table = np.array(rows, dtype=np.int64)
    assert most_advanced(table[:, :2]) == root
    assert holders(table, root) == held


# -- a real TorchState following its steps (no ring: the sampler is told its world)

def make_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 4))
    sampler = elastic.ElasticSampler(data, shuffle=False, num_replicas=1, rank=0)
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
    state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, step=0)
    return state, model, opt, sampler, loader


def one_step(state, model, opt, sampler, batch_idx, x, y):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    sampler.record_batch(batch_idx, len(x))
    state.step += 1


def test_a_torch_state_keeps_what_the_last_completed_step_left_and_puts_its_buffers_back():
    state, model, opt, sampler, loader = make_state()
    batches = list(loader)
    state.take_snapshot()   # commit()'s copy (its membership check needs a ring)
    for i in range(3):
        one_step(state, model, opt, sampler, i, *batches[i])
    params = [p.detach().clone() for p in model.parameters()]
    opt_state = {k: v["momentum_buffer"].clone() for k, v in opt.state.items()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    # Step 4 fails in its backward (a peer died in DDP's allreduce): forward ran, buffers moved.
    x, y = batches[3]
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert not torch.equal(model[1].running_mean, buffers["1.running_mean"])
    assert state.standing() == (0, 3)   # three steps past commit 0
    assert state.live_state_usable() is True
    state.keep_live()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert all(torch.equal(opt.state[k]["momentum_buffer"], v) for k, v in opt_state.items())
    assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())
    assert all(p.grad is None for p in model.parameters())
    assert sampler.processed == 24 and state.step == 3


def test_a_torch_state_restores_after_a_failure_inside_or_right_after_a_step():
    state, model, opt, sampler, loader = make_state()
    batches = list(loader)
    state.take_snapshot()   # commit()'s copy (its membership check needs a ring)
    one_step(state, model, opt, sampler, 0, *batches[0])
    x, y = batches[1]
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()   # a collective now (a loss averaged for the log) would fail after the update ...
    assert state.live_state_usable() is False
    sampler.record_batch(1, len(x))
    assert state.live_state_usable() is False   # ... and before the next forward (state.step not counted yet)


def test_a_torch_state_restores_when_batches_are_recorded_before_their_steps():
    state, model, opt, sampler, loader = make_state()
    batches = list(loader)
    state.take_snapshot()   # commit()'s copy (its membership check needs a ring)
    for i in range(3):   # record, then step: the events never pair
        x, y = batches[i]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        sampler.record_batch(i, len(x))
        opt.step()
    torch.nn.functional.mse_loss(model(batches[3][0]), batches[3][1]).backward()
    assert state.live_state_usable() is False
    state.take_snapshot()   # a commit settles: the next failure at a boundary may keep again
    torch.nn.functional.mse_loss(model(batches[3][0]), batches[3][1]).backward()
    assert state.live_state_usable() is True


def test_an_evaluation_forward_without_gradients_is_not_a_training_step():
    state, model, opt, sampler, loader = make_state()
    batches = list(loader)
    state.take_snapshot()   # commit()'s copy (its membership check needs a ring)
    one_step(state, model, opt, sampler, 0, *batches[0])
    with torch.no_grad():
        model(batches[1][0])   # evaluation between steps: the step's bookkeeping may not be done
    assert state.live_state_usable() is False


def test_a_second_optimizer_held_by_the_state_makes_its_steps_unpaired():
    state, model, opt, sampler, loader = make_state()
    other = torch.optim.SGD(model.parameters(), lr=0.01)
    state.critic_optimizer = other
    batches = list(loader)
    state.take_snapshot()   # commit()'s copy (its membership check needs a ring)
    x, y = batches[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    other.step()
    sampler.record_batch(0, len(x))
    torch.nn.functional.mse_loss(model(batches[1][0]), batches[1][1]).backward()
    assert state.live_state_usable() is False


def test_a_state_without_a_followed_model_and_optimizer_always_restores():
    model = torch.nn.Linear(2, 2)
    assert elastic.TorchState(model=model).live_state_usable() is False
    assert elastic.TorchState(optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).live_state_usable() is False
    assert elastic.ObjectState(step=0).live_state_usable() is False
