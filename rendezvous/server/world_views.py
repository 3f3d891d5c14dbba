"""Each member's view of a world, what its World message carries, and the digest that names the world.

A member is told what it needs to form its rings (semantics 15): its neighbours on the flat ring,
on its host's ring and, on a host's leader, the neighbouring hosts' leaders, with its host's
place among the hosts. `WorldViews` works out the hosts and the digest once per world (O(N)),
after which each member's view costs O(1) to build, so announcing a world of N is O(N) in all,
and every message to a worker has the same size whatever N is.

An announcement queues a `PendingView` on each stream and the stream's own handler builds and
serializes it as it writes: building 16,384 views in one go held the event loop for ~0.3 s,
while spread over the handlers the loop serves the leader's lease refresh in between.
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Iterator, Optional

from rendezvous.wire.membership import Member
from rendezvous.wire.messages import member_pb, pb

def _varint(n: int) -> bytes:
    """`n` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_LENGTH_DELIMITED = 2   # the wire type of a message field
_WORLD_TAG = _varint((pb.WatchEvent.WORLD_FIELD_NUMBER << 3) | _LENGTH_DELIMITED)
_PEER_TAG = _varint((pb.World.PEERS_FIELD_NUMBER << 3) | _LENGTH_DELIMITED)


def world_digest(members: Iterable[Member]) -> bytes:
    """SHA-256 over every member's rank, worker id, host and ring address, in rank order."""
    h = hashlib.sha256(b"elastic-ring world v1\0")
    for m in members:
        h.update(f"{m.rank}\0{m.worker_id}\0{m.host}\0{m.ring_address}\n".encode())
    return h.digest()


class WorldViews:
    """The views of the members of world `world_version` (`members` in rank order, each host's
    ranks contiguous, as decision.compute_world makes them)."""

    def __init__(self, world_version: int, members: tuple[Member, ...]):
        self.world_version = world_version
        self.members = members
        self.digest = world_digest(members)
        self._rank_of = {m.worker_id: m.rank for m in members}
        self._leaders: list[int] = []          # each host's first rank, in host order
        self._host_of: list[int] = []          # each rank's host index
        for m in members:
            if m.local_rank == 0:
                self._leaders.append(m.rank)
            self._host_of.append(len(self._leaders) - 1)
        self._largest = max((m.local_size for m in members), default=0)
        self._peer_field: list[Optional[bytes]] = [None] * len(members)   # by rank, made when first asked

    def member(self, worker_id: str) -> Optional[Member]:
        rank = self._rank_of.get(worker_id)
        return None if rank is None else self.members[rank]

    def peer_ranks(self, m: Member) -> list[int]:
        """The ranks `m`'s rings connect to, its own and rank 0 included, in rank order."""
        n = len(self.members)
        first = m.rank - m.local_rank
        # Rank 0 too: it hosts the store of the world's device communicator (elastic/torchdist).
        ranks = {0, m.rank, (m.rank + 1) % n, (m.rank - 1) % n,
                 first + (m.local_rank + 1) % m.local_size, first + (m.local_rank - 1) % m.local_size}
        if m.local_rank == 0:
            h, hosts = self._host_of[m.rank], len(self._leaders)
            ranks |= {self._leaders[(h - 1) % hosts], self._leaders[(h + 1) % hosts]}
        return sorted(ranks)

    def world(self, m: Member, aborted: Optional[pb.AbortVersion] = None) -> pb.World:
        """The World message `m` receives (carrying the abort of the world before, `aborted`, where
        that notice rides with it: fanout.merged)."""
        return pb.World(peers=[member_pb(self.members[r]) for r in self.peer_ranks(m)], **self._fields(m, aborted))

    def _fields(self, m: Member, aborted: Optional[pb.AbortVersion]) -> dict:
        """Every field of `m`'s World but its peers."""
        h, hosts = self._host_of[m.rank], len(self._leaders)
        return dict(world_version=self.world_version, size=len(self.members), rank=m.rank,
                    local_rank=m.local_rank, local_size=m.local_size, cross_rank=m.cross_rank,
                    cross_size=m.cross_size, digest=self.digest, num_hosts=hosts, host_index=h,
                    largest_host=self._largest, prev_leader=self._leaders[(h - 1) % hosts],
                    next_leader=self._leaders[(h + 1) % hosts], aborted=aborted)

    def event(self, m: Member, aborted: Optional[pb.AbortVersion] = None) -> pb.WatchEvent:
        return pb.WatchEvent(world=self.world(m, aborted))

    def serialized_event(self, m: Member, aborted: Optional[pb.AbortVersion] = None) -> bytes:
        """`event(m, aborted)` serialized, each peer's field encoded once per world: a member is
        the peer of up to eight others, and building its message anew for each was two thirds of
        the cost of a view. A message's fields may come in any order and a repeated one's elements
        are appended as they come, so the World is its other fields, then the peers' (parsed, it
        equals `event`: a table test)."""
        head = pb.World(**self._fields(m, aborted)).SerializeToString()
        world = b"".join([head, *map(self._peer, self.peer_ranks(m))])
        return b"".join((_WORLD_TAG, _varint(len(world)), world))

    def _peer(self, rank: int) -> bytes:
        field = self._peer_field[rank]
        if field is None:
            body = member_pb(self.members[rank]).SerializeToString()
            field = self._peer_field[rank] = b"".join((_PEER_TAG, _varint(len(body)), body))
        return field

    def pending(self, recipients) -> Iterator[tuple[str, "PendingView"]]:
        """(worker_id, its view still to be built) for each member in `recipients`."""
        for m in self.members:
            if m.worker_id in recipients:
                yield m.worker_id, PendingView(self, m)


class PendingView:
    """One member's World message (carrying the abort `aborted`, if one rides with it), built and
    serialized when its stream writes it."""

    __slots__ = ("views", "member", "aborted")

    def __init__(self, views: WorldViews, member: Member, aborted: Optional[pb.AbortVersion] = None):
        self.views, self.member, self.aborted = views, member, aborted

    def serialized(self) -> bytes:
        return self.views.serialized_event(self.member, self.aborted)
