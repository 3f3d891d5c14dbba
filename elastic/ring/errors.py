"""The ring's exceptions, and how the core's failures become them.

Every error that changes what ``elastic.run`` does is told apart by its class and its
``kind`` (an ``ErrorKind`` of the native core, ``elastic.ring._native.ErrorKind``), never by
its text: messages may quote what a peer sent, and a peer must not steer a worker.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from rendezvous.wire.membership import Blame

from elastic.ring._native import ErrorKind, RingFailure

# Kinds where the peer named in the error is to blame: the runtime reports it to the
# rendezvous. Aborted and Propagated name a live neighbour; Refused, SettingsMismatch and
# Mismatch blame nobody (another world version, other settings, a program bug).
_BLAMES_PEER = frozenset({ErrorKind.PeerLost, ErrorKind.Timeout, ErrorKind.Unreachable, ErrorKind.BadPeer})


def _reason(kind: ErrorKind) -> str:
    """``ErrorKind.PeerLost`` -> ``"peer_lost"``: the ``reason`` strings, derived, not listed."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", kind.name).lower()


def _locate(err: Exception, kind: ErrorKind, op: str, world_version: int, rank: int, peer: int) -> None:
    """What every ring error carries: its kind, the operation, world version, this rank, the
    neighbour involved (-1: none) and ``peer_rank``, the rank to blame (None: nobody)."""
    err.kind, err.op, err.world_version, err.rank, err.peer = kind, op, world_version, rank, peer
    err.peer_rank = peer if kind in _BLAMES_PEER and peer >= 0 else None


@dataclasses.dataclass(frozen=True)
class FailedCall:
    """The collective a ring error came from, as this rank called it: its sequence number on
    the communicator, ``tag`` (what it is: kind, dtype, op, size; equal on every rank that called
    the same collective) and its description ("allreduce #7 (float32, 1000 elements, sum)")."""

    seq: int
    tag: int
    describe: str


class ElasticError(Exception):
    """Base class of every elastic-ring error. ``call``: the collective it came from
    (``FailedCall``), when the core raised it in one; None otherwise."""

    __module__ = "elastic"   # its public name, whatever module defines it
    call: Optional[FailedCall] = None


class WorkerLostError(ElasticError):
    """A peer failed, hung or was fenced out while a collective was in flight.

    The communicator that raised it is unusable; ``elastic.run`` restores the last
    commit and re-forms the ring for the next world version. Attributes say where:
    ``op`` (the collective), ``world_version``, ``rank`` (this worker), ``peer`` (the
    neighbour involved, or -1 when none, e.g. after an abort), ``kind`` (an ``ErrorKind``),
    ``peer_rank`` (the rank to blame, or None) and ``reason``, the kind in words:
    ``"peer_lost"`` (the neighbour ``peer`` died or reset), ``"timeout"`` (``peer`` went
    silent), ``"propagated"`` (the neighbour ``peer`` is alive and gave up because of a
    failure further round the ring), ``"aborted"`` (``abort()`` was called, e.g. on a
    rendezvous notice), or for a ``BadPeerError`` ``"unreachable"`` / ``"bad_peer"``.
    """

    __module__ = "elastic"   # its public name, whatever module defines it

    def __init__(self, message: str, *, op: str = "", world_version: int = -1, rank: int = -1,
                 peer: int = -1, kind: ErrorKind = ErrorKind.PeerLost):
        super().__init__(message)
        _locate(self, kind, op, world_version, rank, peer)
        self.reason = _reason(kind)


class BadPeerError(WorkerLostError):
    """A peer cannot be part of a ring: its announced address is unusable (not HOST:PORT,
    a wildcard, a name that does not resolve, nothing accepts connections there: ``kind``
    ``Unreachable``), what answers there does not prove the job's secret or speak the ring
    protocol (``BadPeer``; e.g. a refusal without the secret's MAC, whatever it says), or what
    it sent cannot be received (``BadPeer``: a size or count out of bounds, bytes that do not
    decode, a sync state that does not fit this worker's, as the majority of the world found).

    It is that peer's failure, not this worker's: ``peer_rank`` names it (``peer`` too, here
    not necessarily a neighbour), ``elastic.run`` reports it to the rendezvous, which evicts
    it once the majority of the world blamed it too, and the healthy workers re-form. Nothing it
    sent was loaded. ``blame`` says what it is accused of (``rendezvous.wire.membership.Blame``:
    ``UNUSABLE`` for the above; ``IMPOSSIBLE_ROW`` or ``DIVERGED`` when the world's rows at a
    commit or a form showed it wrote what no worker writes, or ran what the majority did not)."""

    __module__ = "elastic"   # its public name, whatever module defines it

    def __init__(self, message: str, *, op: str = "", world_version: int = -1, rank: int = -1,
                 peer: int = -1, kind: ErrorKind = ErrorKind.BadPeer, blame: Blame = Blame.UNUSABLE):
        super().__init__(message, op=op, world_version=world_version, rank=rank, peer=peer, kind=kind)
        self.blame = blame


class HandshakeError(ElasticError):
    """A ring neighbour that proved the job's secret refused the connection: another world
    version (this worker's is stale), world size or rank, or a duplicate. ``kind`` is
    ``ErrorKind.Refused``; ``peer`` the neighbour; nobody is to blame (``peer_rank`` None)."""

    __module__ = "elastic"   # its public name, whatever module defines it

    def __init__(self, message: str, *, op: str = "form", world_version: int = -1, rank: int = -1, peer: int = -1):
        super().__init__(message)
        _locate(self, ErrorKind.Refused, op, world_version, rank, peer)


class SettingsMismatchError(ElasticError):
    """The ranks of one world run with different ring settings (algorithm, sizes, transport),
    as an authenticated neighbour says or the check at ``connect()`` found. No later world
    fixes that, so ``elastic.run`` ends the worker with it. ``kind`` is
    ``ErrorKind.SettingsMismatch``; ``setting`` names the setting when it is known ("")."""

    __module__ = "elastic"   # its public name, whatever module defines it

    def __init__(self, message: str, *, op: str = "form", world_version: int = -1, rank: int = -1, peer: int = -1,
                 setting: str = "", outvoted: bool = False):
        super().__init__(message)
        _locate(self, ErrorKind.SettingsMismatch, op, world_version, rank, peer)
        self.setting = setting
        self.outvoted = outvoted   # this rank differs from the majority of its world (which goes on)


class CollectiveMismatchError(ElasticError):
    """Ranks called different collectives (or with different sizes).

    Raised first by a collective (``peer``: the rank whose segment did not match); ``elastic.run``
    then forms the world again and its members compare what they called
    (``elastic.runtime.divergence``). Raised again with ``decided`` True, it ends the worker:
    ``outvoted``, this rank called another collective than the majority of its world (which goes
    on without it); otherwise no call was the majority's (a bug in the program)."""

    __module__ = "elastic"   # its public name, whatever module defines it

    def __init__(self, message: str, *, op: str = "", world_version: int = -1, rank: int = -1, peer: int = -1,
                 decided: bool = False, outvoted: bool = False):
        super().__init__(message)
        _locate(self, ErrorKind.Mismatch, op, world_version, rank, peer)
        self.decided = decided
        self.outvoted = outvoted


def from_native(failure: RingFailure) -> Exception:
    """The exception a caller sees for the core's ``RingFailure``, chosen by its kind alone."""
    kind, message, op, world_version, rank, peer = failure.args[:6]
    call = failure.args[6] if len(failure.args) > 6 else None
    err = _of_kind(kind, message, op, dict(world_version=world_version, rank=rank, peer=peer))
    if call is not None and isinstance(err, ElasticError):
        err.call = FailedCall(int(call[0]), int(call[1]), str(call[2]))
    return err


def _of_kind(kind: ErrorKind, message: str, op: str, where: dict) -> Exception:
    if kind in (ErrorKind.Unreachable, ErrorKind.BadPeer):
        return BadPeerError(message, op=op, kind=kind, **where)
    if kind in (ErrorKind.PeerLost, ErrorKind.Timeout, ErrorKind.Aborted, ErrorKind.Propagated):
        return WorkerLostError(message, op=op, kind=kind, **where)
    if kind == ErrorKind.Refused:
        return HandshakeError(message, op=op, **where)
    if kind == ErrorKind.SettingsMismatch:
        return SettingsMismatchError(message, op=op, **where)
    if kind == ErrorKind.Mismatch:
        return CollectiveMismatchError(message, op=op, **where)
    if kind == ErrorKind.Invalid:
        return ValueError(message)
    # A kind this module does not know yet: still an ElasticError, never a crash in the translator.
    err = ElasticError(message)
    _locate(err, kind, op, where["world_version"], where["rank"], where["peer"])
    return err
