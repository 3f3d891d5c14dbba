"""Where a rank stands inside its training step, to tell whether a failure left its live state usable.

In synchronous data parallelism a peer's failure can only surface in a collective. When it
surfaces after the training forward of a step began and before this rank's optimizer changed
anything (DDP's buffer broadcast and gradient allreduce, a ``DistributedOptimizer``'s
``synchronize()``, any collective before ``step()``), the parameters and the optimizer state are
exactly those of the last completed step: the session keeps them instead of restoring the last
commit, and nothing is redone. A ``TorchState`` feeds the events below to ``advance`` as they
happen; ``harmless`` says whether a failure now may keep the live state.

A step is complete once its update ran, its batch was recorded (with an ``ElasticSampler``) and
the next step's training forward began: by then the loop's own bookkeeping (``state.step += 1``,
a metric allreduced after ``step()``) is done too. Anything else cannot be proven harmless and
restores the last commit, as before: a failure inside ``step()`` or between it and the next
forward; and, for good (until the next commit, sync or restore), a pattern the events cannot
pair: a batch recorded before its step (gradient accumulation recording each micro-batch), a
step with no record, two updates in one step (two optimizers), a forward inside ``step()``
(LBFGS's closure). Events, in the order a training step makes them::

    FORWARD -> [collectives] -> UPDATE_BEGINS -> UPDATE_ENDS -> BATCH_RECORDED -> FORWARD (next step)
               (backward)       (optimizer.step() ............)  (record_batch)

``SETTLED`` (a commit, a sync, a restore or a kept live state) puts a rank at a boundary.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    BOUNDARY = "boundary"   # every step taken is complete: the live state is the last completed step's
    UPDATING = "updating"   # inside optimizer.step(): parameters may be half updated
    STEPPED = "stepped"     # the optimizer stepped; its batch not recorded yet (or the step's bookkeeping runs)
    RECORDED = "recorded"   # stepped and recorded; the step's bookkeeping may still run until the next forward
    UNPAIRED = "unpaired"   # the events do not pair up as one update per recorded batch: never harmless


class Event(enum.Enum):
    FORWARD = "forward"                 # a training forward (gradients enabled) begins
    UPDATE_BEGINS = "update_begins"     # optimizer.step() starts changing parameters
    UPDATE_ENDS = "update_ends"         # it returned
    BATCH_RECORDED = "batch_recorded"   # ElasticSampler.record_batch()
    SETTLED = "settled"                 # a commit, sync, restore or kept live state: a step boundary


def advance(phase: Phase, event: Event, records_batches: bool) -> Phase:
    """The phase after ``event``; ``records_batches``: the state holds an ``ElasticSampler``, so
    a step is complete only once its batch is recorded."""
    if not isinstance(event, Event):
        raise ValueError(f"not a step event: {event!r}")
    if event is Event.SETTLED:
        return Phase.BOUNDARY
    if phase is Phase.UNPAIRED:
        return phase
    if event is Event.FORWARD:
        if phase is Phase.BOUNDARY or phase is Phase.RECORDED:
            return Phase.BOUNDARY   # more micro-batches of a step, or the next step
        if phase is Phase.STEPPED and not records_batches:
            return Phase.BOUNDARY
        return Phase.UNPAIRED       # a forward inside step(), or after a step whose batch was never recorded
    if event is Event.UPDATE_BEGINS:
        # Nested: an optimizer subclass's step() calling its base class's runs the hooks twice.
        return Phase.UPDATING if phase in (Phase.BOUNDARY, Phase.UPDATING) else Phase.UNPAIRED
    if event is Event.UPDATE_ENDS:
        return Phase.STEPPED if phase in (Phase.UPDATING, Phase.STEPPED) else Phase.UNPAIRED
    # BATCH_RECORDED
    if phase is Phase.STEPPED and records_batches:
        return Phase.RECORDED
    return Phase.UNPAIRED           # recorded before its step, or twice


def completes_a_step(before: Phase, after: Phase) -> bool:
    """Whether the transition ``before`` -> ``after`` completed a step (counted as progress past
    the last commit, which the sync compares)."""
    return after is Phase.BOUNDARY and before in (Phase.STEPPED, Phase.RECORDED)


def harmless(phase: Phase) -> bool:
    """Whether a failure surfacing now leaves the live model and optimizer those of the last
    completed step (so they are kept, not restored)."""
    return phase is Phase.BOUNDARY
