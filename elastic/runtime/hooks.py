"""What a layer above the ring (the torch group, DDP, a sharded state) plugs into the step protocol.

The step protocol (``elastic.runtime.session``'s module doc says when each hook runs) knows no
layer by name: a layer subclasses ``StepHooks``, overrides what it needs, and hands an instance to
the session it runs in (``Session.add_hooks``) when that session's run starts: ``elastic.run``
attaches the torch layer, a ``ShardedState`` adds its own at its first sync. Nothing registers
on import. Hooks run in the order they were added. A hook that runs collectives must run the same
ones on every rank: every rank runs the same script, so the same layers attach alike, and the
protocol calls them at the same points on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from rendezvous.client.watch_events import WorldInfo


@dataclasses.dataclass(frozen=True)
class WorldChange:
    """A re-form, as every rank of the new world sees it."""

    previous: Optional[WorldInfo]   # the world this worker was in before (None: its first)
    current: WorldInfo              # the world just formed: its members by worker id, in rank order
    restored: bool                  # the state was rolled back to the last commit (a failure), not kept


class StepHooks:
    """Override what a layer needs; every method here does nothing."""

    def run_starting(self, default_group: bool) -> None:
        """``elastic.run`` begins, before the first world; ``default_group`` is
        ``WorkerConfig.default_group`` (ELASTIC_DEFAULT_GROUP)."""

    def world_changed(self, change: WorldChange) -> None:
        """A ring of a new world has formed (every rank of it), before the reset callbacks and the sync."""

    def before_sync(self, state: Any) -> None:
        """The sync is about to agree on the most advanced commit (every rank, on the ring of the sync)."""

    def after_sync(self, state: Any, root: int) -> None:
        """Every rank holds the state rank ``root`` sent; the ring is the new world's or the kept one."""

    def committed(self, state: Any, commit_step: int) -> None:
        """Commit ``commit_step`` was just taken in memory, before the membership check of that commit."""

    def ring_aborted(self, reason: str) -> None:
        """The session aborted the ring it holds (a peer failed, the world was superseded): a layer
        with work of its own behind the ring (a device communicator) aborts it too. Runs on
        whichever thread aborted, the session's event thread among them: it must not block long."""

    def ring_closed(self) -> None:
        """The session closed the ring it held (this worker left, the run ended, or the ring kept
        after it was closed): a layer releases what it runs behind that ring."""
