"""The runtime's exceptions: membership changes, the rendezvous, waits that ran out, and graceful leaves.

What ``elastic.run`` does after one is decided by its class (``elastic.runtime.reaction``), never
by its text. The ring's own failures are in ``elastic.ring.errors``.
"""

from __future__ import annotations

from elastic.ring.errors import ElasticError


class MembershipChanged(ElasticError):
    """Workers joined or left cleanly; state is kept and the ring re-formed."""

    __module__ = "elastic"   # its public name, whatever module defines it


class RendezvousError(ElasticError):
    """The job's membership could not be agreed (rendezvous or ring forming failed)."""

    __module__ = "elastic"   # its public name, whatever module defines it


class ElasticTimeout(ElasticError):
    """A wait ran out: the job stayed below its minimum size for longer than its elastic timeout
    (the rendezvous ended it as failed), or no world included this worker within
    ``ELASTIC_WORLD_TIMEOUT``."""

    __module__ = "elastic"   # its public name, whatever module defines it


# The status a worker exits with when the majority of its world outvoted it (``Outvoted``):
# elastic-run respawns its slot until it was outvoted DIVERGED_LIMIT times (elastic.launch.procs).
DIVERGED_EXIT = 76


class Outvoted(SystemExit):
    """``elastic.run`` ended because this worker differed from the majority of its world: it
    called another collective than they did, or formed its ring with other ring settings
    (``error``, also the ``__cause__``: a ``CollectiveMismatchError`` or ``SettingsMismatchError``).
    The others blamed it and go on without it.

    A ``SystemExit`` with code ``DIVERGED_EXIT`` (76): uncaught, the process exits 76 without
    running the code after the training function's call, which elastic-run reads as outvoted:
    it respawns the slot (a data-dependent branch may not diverge again) until the slot was
    outvoted 3 times, then says why and respawns it no more (a stale image or other settings
    diverge every time); the job goes on. ``except Exception`` does not catch it."""

    __module__ = "elastic"   # its public name, whatever module defines it

    def __init__(self, error: BaseException):
        super().__init__(DIVERGED_EXIT)
        self.error = error

    def __str__(self) -> str:
        return f"outvoted by the majority of its world: {self.error}"


class LeftJob(SystemExit):
    """``elastic.run`` ended because this worker left the job gracefully, at a commit boundary
    every rank agreed on; the subclass says what asked it to: ``Preempted`` (SIGTERM, SIGINT),
    ``LeaveRequested`` (``elastic.request_leave()``) or ``EvictedAsStraggler`` (the straggler
    policy ``evict`` chose it).

    A ``SystemExit`` with code 0: uncaught, the process exits 0 without running the code after
    the training function's call (its result does not exist: training did not finish here), and
    ``except Exception`` does not catch it. Catch ``elastic.LeftJob`` (or one subclass) to run code
    on the way out; the job goes on without this worker, the others keep their state. ``reason``
    says what asked for the leave, ``world_version`` and ``commit_step`` where it happened."""

    __module__ = "elastic"   # its public name, whatever module defines it

    def __init__(self, reason: str, *, world_version: int = -1, commit_step: int = -1, held: str = ""):
        super().__init__(0)
        self.reason, self.world_version, self.commit_step = reason, world_version, commit_step
        self.held = held or f"commit {commit_step}"   # the commit and the training step it holds

    def __str__(self) -> str:
        return f"left the job gracefully ({self.reason}) at {self.held} of world version {self.world_version}"


class Preempted(LeftJob):
    """This worker left because it was preempted: SIGTERM or SIGINT (a scheduler's notice,
    ``scancel``, Kubernetes eviction, elastic-run passing on its own signal or dropping the host)."""

    __module__ = "elastic"   # its public name, whatever module defines it


class LeaveRequested(LeftJob):
    """This worker left because the program asked it to (``elastic.request_leave()``)."""

    __module__ = "elastic"   # its public name, whatever module defines it


class EvictedAsStraggler(LeftJob):
    """This worker left because it was the straggler the ``evict`` policy removes."""

    __module__ = "elastic"   # its public name, whatever module defines it
