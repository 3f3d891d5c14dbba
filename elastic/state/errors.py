"""The state layer's exception: a sync the majority of a world refused."""

from __future__ import annotations

from elastic.ring.errors import ElasticError


class SyncRefusedError(ElasticError):
    """The majority of a world refused this worker's part of a sync: the state it sent as the
    most advanced one did not decode or fit theirs, or (as one of a minority) its own state
    does not fit the state the others accepted. No later world fixes that, so ``elastic.run``
    ends this worker with it; the others go on without it. ``world_version``, ``rank`` and
    ``peer`` (the sync's root) say where; ``refused_by`` lists the ranks that refused."""

    __module__ = "elastic"   # its public name, whatever module defines it

    def __init__(self, message: str, *, world_version: int = -1, rank: int = -1, peer: int = -1,
                 refused_by: tuple = ()):
        super().__init__(message)
        self.op, self.world_version, self.rank, self.peer = "sync", world_version, rank, peer
        self.refused_by = tuple(refused_by)
