"""Exceptions of elastic-ring, and the mapping from the native core's failures."""

from __future__ import annotations


class ElasticError(Exception):
    """Base class of every elastic-ring error."""


class WorkerLostError(ElasticError):
    """A peer failed, hung or was fenced out while a collective was in flight.

    The communicator that raised it is unusable; ``elastic.run`` restores the last
    commit and re-forms the ring for the next world version. Attributes say where:
    ``op`` (the collective), ``world_version``, ``rank`` (this worker), ``peer`` (the
    suspected rank, or -1 when unknown, e.g. after an abort) and ``reason``: ``"peer_lost"``
    (the neighbour ``peer`` died or reset), ``"timeout"`` (``peer`` went silent), ``"propagated"``
    (the neighbour ``peer`` is alive and gave up because of a failure further round the ring)
    or ``"aborted"`` (``abort()`` was called, e.g. on a rendezvous notice).
    """

    def __init__(self, message: str, *, op: str = "", world_version: int = -1, rank: int = -1,
                 peer: int = -1, reason: str = "peer_lost"):
        super().__init__(message)
        self.op = op
        self.world_version = world_version
        self.rank = rank
        self.peer = peer
        self.reason = reason


class MembershipChanged(ElasticError):
    """Workers joined or left cleanly; state is kept and the ring re-formed."""


class RendezvousError(ElasticError):
    """The job's membership could not be agreed (rendezvous or ring forming failed)."""


class HandshakeError(RendezvousError):
    """A ring neighbour refused the connection: wrong job, wrong secret or another world version."""

    def __init__(self, message: str, *, world_version: int = -1, rank: int = -1, peer: int = -1):
        super().__init__(message)
        self.world_version = world_version
        self.rank = rank
        self.peer = peer


class CollectiveMismatchError(ElasticError):
    """Ranks called different collectives (or with different sizes): a bug in the program."""

    def __init__(self, message: str, *, op: str = "", world_version: int = -1, rank: int = -1, peer: int = -1):
        super().__init__(message)
        self.op = op
        self.world_version = world_version
        self.rank = rank
        self.peer = peer


class ElasticTimeout(ElasticError):
    """The job stayed below its minimum size for longer than its elastic timeout."""


# Mirrors ering::ErrorKind in native/src/common.h.
_PEER_LOST, _TIMEOUT, _ABORTED, _REFUSED, _INVALID, _MISMATCH, _PROPAGATED = range(7)
_REASONS = {_PEER_LOST: "peer_lost", _TIMEOUT: "timeout", _ABORTED: "aborted", _PROPAGATED: "propagated"}


def _from_native(kind: int, message: str, op: str, world_version: int, rank: int, peer: int) -> Exception:
    """Builds the Python exception for a native CommError (called by the binding)."""
    if kind in _REASONS:
        return WorkerLostError(message, op=op, world_version=world_version, rank=rank, peer=peer,
                               reason=_REASONS[kind])
    if kind == _REFUSED:
        return HandshakeError(message, world_version=world_version, rank=rank, peer=peer)
    if kind == _MISMATCH:
        return CollectiveMismatchError(message, op=op, world_version=world_version, rank=rank, peer=peer)
    return ValueError(message)
