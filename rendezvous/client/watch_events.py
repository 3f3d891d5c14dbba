"""What a worker learns on its Watch stream, as typed values: the worlds it is a member of, and the
notices around them (`RendezvousClient.next_event` returns them; elastic/runtime/reaction.py decides what
each means for the ring held).

After `Abort(V)` a member of V failed, so abort what is in flight and form the ring of the next
`WorldInfo`; after `Pending(V)` a clean join/leave is coming, so keep training in V and move to the
next `WorldInfo` at a commit boundary every member agrees on. A `Standby` worker waits for a world
that includes it. `Finished` says how the job ended; `Ended` means the server no longer knows this
session (it was evicted, e.g. after being stopped longer than the heartbeat timeout): join again.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

from rendezvous.wire.membership import Member


@dataclasses.dataclass(frozen=True)
class WorldInfo:
    """A world this worker is a member of, as its view: not every member, but the ones its rings
    connect to (`peers`, itself included, in rank order), its host's place among the hosts, and
    the digest naming the whole world (two views of one world have the same digest)."""

    world_version: int
    peers: tuple[Member, ...]
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    digest: bytes = b""
    num_hosts: int = 1
    host_index: int = 0
    largest_host: int = 1
    prev_leader: int = 0
    next_leader: int = 0

    def peer(self, rank: int) -> Optional[Member]:
        """The member of `rank` if this view names it (a ring neighbour), else None."""
        return next((m for m in self.peers if m.rank == rank), None)


@dataclasses.dataclass(frozen=True)
class Pending:
    """A clean join/leave is coming: switch to the next world at a commit boundary."""

    world_version: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Abort:
    """A member of `world_version` failed: abort what is in flight and wait for the next world."""

    world_version: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Standby:
    world_version: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Finished:
    succeeded: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class Ended:
    """This session is over (evicted, replaced, or no server reachable): join again or give up.
    `finished` is True/False when it ended because the job succeeded/failed (join no more)."""

    reason: str
    finished: Optional[bool] = None


Event = Union[WorldInfo, Pending, Abort, Standby, Finished, Ended]
