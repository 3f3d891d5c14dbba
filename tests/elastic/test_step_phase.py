"""Where a step stands, and which failures keep the live state: table tests of elastic.step_phase."""

from __future__ import annotations

import pytest

from elastic.step_phase import Event, Phase, advance, harmless

B, U, S, A = Phase.BOUNDARY, Phase.UPDATING, Phase.STEPPED, Phase.AHEAD
BEGINS, ENDS, RECORDED, SETTLED = Event.UPDATE_BEGINS, Event.UPDATE_ENDS, Event.BATCH_RECORDED, Event.SETTLED


def run(events, records_batches=True, phase=B):
    seen = []
    for e in events:
        phase = advance(phase, e, records_batches)
        seen.append(phase)
    return seen


@pytest.mark.parametrize("events, records_batches, phases", [
    # The contract's loop: step, then record the batch; complete once recorded.
    ([BEGINS, ENDS, RECORDED], True, [U, S, B]),
    ([BEGINS, ENDS, RECORDED, BEGINS, ENDS, RECORDED], True, [U, S, B, U, S, B]),
    # No sampler: complete when step() returns.
    ([BEGINS, ENDS], False, [U, B]),
    # Gradient accumulation recording each micro-batch: the recorded ones have no step yet.
    ([RECORDED, RECORDED, BEGINS, ENDS, RECORDED], True, [A, A, U, S, B]),
    # Two steps before one record: the first step's batch was never recorded.
    ([BEGINS, ENDS, BEGINS, ENDS, RECORDED], True, [U, S, U, S, B]),
    # A commit, sync, restore or kept state settles wherever the step stood.
    ([BEGINS, SETTLED], True, [U, B]),
    ([RECORDED, SETTLED], True, [A, B]),
])
def test_a_step_is_complete_once_stepped_and_recorded(events, records_batches, phases):
    assert run(events, records_batches) == phases


@pytest.mark.parametrize("phase, kept", [(B, True), (U, False), (S, False), (A, False)])
def test_only_a_failure_at_a_step_boundary_keeps_the_live_state(phase, kept):
    # Inside step() parameters may be half updated; after it, its batch is not recorded yet
    # (its samples would be trained again); after a record without a step, they would be lost.
    assert harmless(phase) is kept


def test_a_failure_in_the_gradient_allreduce_is_harmless_and_one_inside_the_update_is_not():
    phase = advance(B, BEGINS, True)            # backward's allreduce failed before: still B
    assert harmless(B) and not harmless(phase)


def test_an_unknown_event_is_refused():
    with pytest.raises(ValueError, match="not a step event"):
        advance(B, "update_begins", True)
