"""What a layer above the ring (the torch group, DDP, a sharded state) plugs into the step protocol.

The step protocol (``elastic.runtime.session``'s module doc says when each hook runs) knows no adapter
by name: a layer subclasses ``StepHooks``, overrides what it needs, and registers an instance
with ``add_hooks``. Hooks are process-wide (they outlive a session: a DDP built before
``elastic.run`` is still there in the next one) and run in the order they were registered.
A hook that runs collectives must run the same ones on every rank: every rank registers the
same hooks (the same script imports the same layers) and the protocol calls them at the same
points on every rank.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, List, Optional

from rendezvous.client.watch_events import WorldInfo

from elastic.ring.errors import WorkerLostError


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

    def committed(self, state: Any, step: int) -> None:
        """Commit ``step`` was just taken in memory, before the membership check of that commit."""

    def failure_behind(self, error: BaseException) -> Optional[WorkerLostError]:
        """The ring failure behind ``error``, an exception that escaped the training function (torch
        turns a failed DDP comm hook into a ``RuntimeError``); None when it is not one this layer knows."""
        return None


_lock = threading.Lock()
_hooks: List[StepHooks] = []


def add_hooks(hooks: StepHooks) -> None:
    """Registers ``hooks`` with the step protocol (idempotent)."""
    with _lock:
        if not any(h is hooks for h in _hooks):
            _hooks.append(hooks)


def remove_hooks(hooks: StepHooks) -> None:
    with _lock:
        _hooks[:] = [h for h in _hooks if h is not hooks]


def registered() -> List[StepHooks]:
    """The hooks, in registration order (a copy: a hook may register another)."""
    with _lock:
        return list(_hooks)
