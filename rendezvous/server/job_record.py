"""The leader's in-memory record of each job it serves, and of each open Watch stream.

A job's record holds its state as decided and as last stored (the journal's), and what hangs on it:
open streams, its liveness clocks (liveness.py, their one owner), outstanding probes, its timer,
its members' straggler reports (pace.py) and the failure reports heard in its world (probes.py):
soft state, never stored."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Optional

from rendezvous.server import decision as d
from rendezvous.server.fanout import FanOut
from rendezvous.server.liveness import Liveness
from rendezvous.server.pace import StragglerBoard
from rendezvous.server.world_views import WorldViews

# Queued on a stream: end it without a status (the client reconnects, or the job is over).
END = object()


@dataclass
class Stream:
    """One open Watch: the handler writes what is queued (WatchEvents, serialized ones, a
    world_views.PendingView to build and serialize, END, or a server_wire.RpcRefusal to fail the
    call with)."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    closed_by_server: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)   # the handler returned


@dataclass
class Job:
    state: d.JobState
    revision: int                          # store revision of the last durable state
    liveness: Liveness                     # Watch deadlines, idle deadline, recovery clock
    durable_state: Optional[d.JobState] = None  # the state as last written (what Watch snapshots show)
    seq: int = 0                           # in-memory change counter
    durable_seq: int = 0
    outbox: list = field(default_factory=list)          # (seq, action, state the decision started from)
    streams: dict = field(default_factory=dict)         # worker_id -> Stream
    probes: dict = field(default_factory=dict)          # nonce -> (worker id probed, Future)
    durable: asyncio.Condition = field(default_factory=asyncio.Condition)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    flushing: bool = False
    timer: Optional[asyncio.Task] = None
    # Set (and replaced) whenever a stream attaches: what a report waiting for a suspect waits on.
    attached: asyncio.Event = field(default_factory=asyncio.Event)
    closing: bool = False                  # being removed from the store or replaced: RPCs retry
    stragglers: StragglerBoard = field(default_factory=StragglerBoard)
    # (world version, suspect) -> {reporter: Blame}: the failure reports heard about a member of
    # the current world (probes.py: an accusation needs a majority of them). Soft state.
    reports: dict = field(default_factory=dict)
    reported: asyncio.Event = field(default_factory=asyncio.Event)   # set (and replaced) on each report
    # worker id -> (the newest world it completed a training step in, the step its last commit
    # holds): what its ReportProgress said, for Status. Soft state: resent, never stored.
    progress: dict = field(default_factory=dict)
    _views: Optional[WorldViews] = None    # of the last world asked for (see views())
    fanout: FanOut = field(init=False)     # how everything sent to the streams is put on them

    def __post_init__(self):
        self.fanout = FanOut(self.streams, lambda: self.state.world_version)

    def views(self, world_version: int, members: tuple) -> WorldViews:
        """The views of world `world_version` of `members`, worked out once per world (O(N)) and
        kept, so that each member's announcement and each (re)attaching Watch costs O(1)."""
        v = self._views
        if v is None or v.world_version != world_version or v.members is not members:
            v = self._views = WorldViews(world_version, members)
        return v
