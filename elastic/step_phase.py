"""Where a rank stands inside its training step, to tell whether a failure left its live state usable.

In synchronous data parallelism a peer's failure can only surface in a collective. When it
surfaces before this rank's optimizer changed anything since its last completed step (inside
DDP's gradient allreduce in backward, in a ``DistributedOptimizer``'s ``synchronize()``, in any
collective before ``step()``), the parameters and the optimizer state are exactly those of that
step: the session keeps them instead of restoring the last commit, and nothing is redone. A
``TorchState`` feeds the events below to ``advance`` as they happen; ``harmless`` says whether a
failure now may keep the live state. Where it cannot be proven harmless (inside ``step()``,
after a step whose batch the sampler has not recorded yet, after a batch recorded before its
step as with gradient accumulation) the state is restored as before, and the restore counted.

Events, in the order a training step makes them::

    [forward, backward: collectives] -> UPDATE_BEGINS -> UPDATE_ENDS -> BATCH_RECORDED
                                         (optimizer.step())              (sampler.record_batch)

``BOUNDARY`` is where a commit, a sync, a restore or a kept live state leave a rank too.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    BOUNDARY = "boundary"   # every step taken is complete and its batch recorded: the live state is a step's
    UPDATING = "updating"   # inside optimizer.step(): parameters may be half updated
    STEPPED = "stepped"     # the optimizer stepped; the sampler has not recorded that step's batch yet
    AHEAD = "ahead"         # a batch recorded with no step after it yet (its gradient would be lost)


class Event(enum.Enum):
    UPDATE_BEGINS = "update_begins"     # optimizer.step() starts changing parameters
    UPDATE_ENDS = "update_ends"         # it returned
    BATCH_RECORDED = "batch_recorded"   # ElasticSampler.record_batch()
    SETTLED = "settled"                 # a commit, sync, restore or kept live state: a step boundary


def advance(phase: Phase, event: Event, records_batches: bool) -> Phase:
    """The phase after ``event``; ``records_batches``: the state holds an ``ElasticSampler``, so
    a step is complete only once its batch is recorded (else at the end of ``step()``)."""
    if event is Event.SETTLED:
        return Phase.BOUNDARY
    if event is Event.UPDATE_BEGINS:
        return Phase.UPDATING
    if event is Event.UPDATE_ENDS:
        return Phase.STEPPED if records_batches else Phase.BOUNDARY
    if event is Event.BATCH_RECORDED:
        return Phase.BOUNDARY if phase is Phase.STEPPED else Phase.AHEAD
    raise ValueError(f"not a step event: {event!r}")


def harmless(phase: Phase) -> bool:
    """Whether a failure surfacing now leaves the live model and optimizer those of the last
    completed step (so they are kept, not restored)."""
    return phase is Phase.BOUNDARY
