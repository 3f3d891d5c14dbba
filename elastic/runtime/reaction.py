"""The worker's reaction to rendezvous events: a pure function ``react(view, event) -> (view, actions)``.

The rendezvous server decides who is in the job (``rendezvous/server/decision.py``); each worker then has
to decide what an announcement means for the ring it holds right now. That decision lives here,
without sockets, threads or clocks, so every rule is a row of a table test
(``tests/elastic/test_reaction.py``); the session object feeds it the events its pump thread reads
and carries out the actions.

Rules:
* A world that includes this worker becomes the one to take next when it is newer than the last,
  or has the same version with other members (the server re-announces a world after a suspect
  turned out alive). The same world again (a reattach after a server restart resends it) is nothing.
* A ring still forming is aborted when a newer world is announced: it can never complete.
* An abort of version v aborts a ring at version <= v; except that a healthy older ring that is
  waiting to switch cleanly at its next commit ignores the abort of the newer world it would switch to.
* A clean change (pending) is only recorded: the switch happens at a commit boundary every rank agrees on.
* A job that failed aborts the ring at once; a job that succeeded lets the ring finish what it does.
* An ended session aborts the ring: its peers will not hear from this membership again.
* Standby (a world without this worker) is recorded; an older ring keeps running until its next
  commit boundary, where the pending change moves this worker out.

And what the session's loop does after an error (``after_error``), when it forms a ring
(``must_form``) and when a ring that just connected is already dead (``aborted_while_forming``):
* A lost worker (``WorkerLostError``, ``BadPeerError`` too): restore the last commit (or keep the
  live state where it is usable: nothing changed it since the last completed step), report the
  suspect, take a world newer than both the ring held and the one the error names.
* A neighbour at another world version (``HandshakeError``): ours is stale; restore (or keep the
  live state), and take a world newer than the one held. Nothing to report: the neighbour is alive.
* A clean join or leave (``MembershipChanged``): keep the state, take a world newer than the one held.
* Ranks calling different collectives (``CollectiveMismatchError``): restore (or keep the live
  state) as after a failure, and report the rank whose segment did not match as failed, so the
  world is formed again; its members then compare what they called first
  (``elastic.runtime.divergence``). Nothing to report when the server announced meanwhile that the
  world ends (``world_moved_on``: a member left it, its function having returned while this one
  trained on, and its return check met this rank's collective). The comparison's own verdict
  (``decided``: this rank is outvoted, or no call is the majority's) ends the worker (None).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Tuple, Union

from rendezvous.client.watch_events import Abort, Ended, Event, Finished, Pending, Standby, WorldInfo

from elastic.ring.errors import CollectiveMismatchError, HandshakeError, WorkerLostError
from elastic.runtime.errors import MembershipChanged


@dataclasses.dataclass(frozen=True)
class View:
    """What a worker knows of its job, as far as its reactions need it."""

    ring_world_version: int = 0              # version of the ring this worker holds (formed or forming); 0: none
    ring_formed: bool = False          # that ring has connected
    latest: Optional[WorldInfo] = None  # newest announced world that includes this worker
    seen_version: int = 0              # newest world version announced to this worker, with it or not
    pending_version: int = -1          # newest version with a clean change pending
    aborted_version: int = -1          # newest version a member of which failed
    finished: Optional[Finished] = None
    ended: Optional[Ended] = None      # the session's end, until the worker joins again


@dataclasses.dataclass(frozen=True)
class AbortRing:
    """Abort the ring this worker holds: whatever is in flight fails on every rank."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Note:
    """Worth a log line, changes nothing."""

    message: str


Action = Union[AbortRing, Note]


def react(view: View, event: Event) -> Tuple[View, Tuple[Action, ...]]:
    """The new view and what to do, for one event read from the rendezvous stream."""
    holding = view.ring_world_version > 0
    if isinstance(event, WorldInfo):
        latest = view.latest
        if latest is None or event.world_version > latest.world_version or \
                (event.world_version == latest.world_version and event.digest != latest.digest):
            latest = event
        view = dataclasses.replace(view, latest=latest, seen_version=max(view.seen_version, event.world_version))
        if holding and not view.ring_formed and view.ring_world_version < event.world_version:
            return view, (AbortRing(f"world version {view.ring_world_version} superseded by {event.world_version} "
                                    f"while forming"),)
        return view, ()
    if isinstance(event, Pending):
        return dataclasses.replace(view, pending_version=max(view.pending_version, event.world_version)), ()
    if isinstance(event, Abort):
        view = dataclasses.replace(view, aborted_version=max(view.aborted_version, event.world_version))
        # A ring waiting for a clean switch at its next commit is healthy: the abort of the newer
        # world it will switch to is not about it.
        waiting_to_switch = (view.ring_world_version < event.world_version and
                             view.pending_version >= view.ring_world_version)
        if holding and view.ring_world_version <= event.world_version and not waiting_to_switch:
            return view, (AbortRing(f"rendezvous: {event.reason}"),)
        return view, ()
    if isinstance(event, Finished):
        view = dataclasses.replace(view, finished=event)
        if holding and not event.succeeded:
            return view, (AbortRing(f"job failed: {event.reason}"),)
        if holding and not view.ring_formed:   # a ring still forming has no run to finish: stop waiting
            return view, (AbortRing(f"job finished while world version {view.ring_world_version} formed: "
                                    f"{event.reason}"),)
        return view, ()
    if isinstance(event, Ended):
        view = dataclasses.replace(view, ended=event)
        if holding:
            return view, (AbortRing(f"rendezvous session ended: {event.reason}"),)
        return view, ()
    if isinstance(event, Standby):
        view = dataclasses.replace(view, seen_version=max(view.seen_version, event.world_version))
        return view, (Note(f"on standby: {event.reason}"),)
    raise TypeError(f"not a rendezvous event: {type(event).__name__}")


def holding(view: View, version: int, formed: bool = False) -> View:
    """The view once this worker holds the ring of world ``version`` (forming, or ``formed``)."""
    return dataclasses.replace(view, ring_world_version=version, ring_formed=formed)


def membership_pending(view: View) -> bool:
    """A clean join/leave waits to take effect at the next commit of the ring held."""
    if view.ring_world_version <= 0:
        return False
    return view.pending_version >= view.ring_world_version or \
        (view.latest is not None and view.latest.world_version > view.ring_world_version)


def superseded(view: View, version: int) -> bool:
    """World ``version`` was aborted or replaced before its ring formed: forming it is pointless."""
    return view.aborted_version >= version or (view.latest is not None and view.latest.world_version > version)


def world_to_take(view: View, min_version: int) -> Optional[WorldInfo]:
    """The world to form next, if one at ``min_version`` or newer includes this worker."""
    w = view.latest
    return w if w is not None and w.world_version >= min_version else None


def rejoined(view: View) -> Tuple[View, int]:
    """The view after joining again as a new member, and the lowest world version to take:
    a new member makes a new world, so no world seen before will do."""
    return dataclasses.replace(view, latest=None, ended=None), view.seen_version + 1


def aborted_while_forming(view: View, version: int) -> bool:
    """The ring of world ``version`` connected, but an abort of that version (or a newer one)
    arrived meanwhile: its peers are gone or going, so it must fail now, not at its first collective."""
    return view.aborted_version >= version


def must_form(ring_world_version: int, ring_failed: bool, min_version: int) -> bool:
    """Whether the loop forms a new ring before it syncs: it holds none (``ring_world_version`` 0),
    the one it holds failed, or that one is older than the world it must take."""
    return ring_world_version <= 0 or ring_failed or ring_world_version < min_version


class StateAction(enum.Enum):
    """What a recovery does with the state."""

    KEEP = "keep"            # a clean change: nothing failed, the state stays as it is
    KEEP_LIVE = "keep_live"  # a failure before the optimizer changed anything: the live state stays
    RESTORE = "restore"      # a failure: the state rolls back to the last commit


@dataclasses.dataclass(frozen=True)
class Recovery:
    """The whole plan after an error the training function (or a form, or a sync) raised."""

    min_version: int     # the lowest world version to take next
    state: StateAction   # keep, keep live, or restore
    report: bool         # tell the rendezvous which peer broke
    stale: bool          # this worker's world is stale (a neighbour at another version), not a failure of a peer


def after_error(error: BaseException, ring_world_version: int, live_state_usable: bool) -> Optional[Recovery]:
    """The plan for ``error`` while holding the ring of ``ring_world_version`` (0: none);
    ``live_state_usable``: the state can keep its live values (the failure came before the
    optimizer changed anything, ``State.live_state_usable``). None for an error that is not the
    loop's to handle (it ends the worker)."""
    failed = StateAction.KEEP_LIVE if live_state_usable else StateAction.RESTORE
    if isinstance(error, WorkerLostError):   # BadPeerError too: reported as an unusable address
        return Recovery(max(error.world_version, ring_world_version) + 1, failed, report=True, stale=False)
    if isinstance(error, HandshakeError):
        return Recovery(ring_world_version + 1, failed, report=False, stale=True)
    if isinstance(error, MembershipChanged):
        return Recovery(ring_world_version + 1, StateAction.KEEP, report=False, stale=False)
    return None


def world_moved_on(view: View, world_version: int) -> bool:
    """The server announced that world ``world_version`` ends: a change pending, an abort, or a newer world."""
    return (view.pending_version >= world_version or view.aborted_version >= world_version
            or view.seen_version > world_version)


def after_mismatch(error: CollectiveMismatchError, ring_world_version: int, live_state_usable: bool,
                   moved_on: bool) -> Optional[Recovery]:
    """The plan for a collective mismatch in world ``error.world_version``: None for the world's
    verdict on it (``error.decided``: it ends the worker); else re-form as after a failure,
    reporting the sender unless the server announced that world ends (``moved_on``)."""
    if error.decided:
        return None
    failed = StateAction.KEEP_LIVE if live_state_usable else StateAction.RESTORE
    return Recovery(max(error.world_version, ring_world_version) + 1, failed, report=not moved_on, stale=False)
