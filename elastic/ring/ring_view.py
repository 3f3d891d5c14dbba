"""What a rank is told of its world to form its rings: a view, not the member list.

A worker in a job of N gets from the rendezvous only the ranks it connects to (its flat-ring
neighbours, its host-local ring neighbours, and, on a host's leader, the neighbouring hosts'
leaders), the layout of its own host and a digest naming the whole world: O(1) whatever N is.
The ring handshake carries the digest, so ranks holding views of two different worlds under
one version refuse each other (native/src/transport/handshake.h).

A ring formed by hand from a full address list (tools, tests) gets the same view from
``RingView.of_full_list``, whose digest hashes that list.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Mapping, Optional, Sequence, Tuple

DIGEST_BYTES = 32


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """Where a rank's host sits among the world's hosts, as far as that rank needs it."""

    num_hosts: int       # hosts in rank order (each host's ranks are contiguous)
    host: int            # this rank's host index
    local_rank: int      # its place among its host's ranks (0: the host's leader)
    local_size: int      # ranks on its host
    first: int           # the rank of its host's leader
    prev_leader: int     # the rank of the previous host's leader (cyclic)
    next_leader: int     # the rank of the next host's leader (cyclic)
    largest_host: int    # ranks on the most populated host

    def numbers(self) -> list:
        return [self.num_hosts, self.host, self.local_rank, self.local_size, self.first, self.prev_leader,
                self.next_leader, self.largest_host]

    def neighbours(self, rank: int) -> Tuple[int, ...]:
        """The ranks besides the flat ring's that `rank`'s hierarchical rings connect to."""
        out = [self.first + (self.local_rank + 1) % self.local_size,
               self.first + (self.local_rank - 1) % self.local_size]
        if self.local_rank == 0:
            out += [self.prev_leader, self.next_leader]
        return tuple(r for r in out if r != rank)


@dataclasses.dataclass(frozen=True)
class RingView:
    """The ranks a rank connects to, by rank: (ring address, host name or "")."""

    rank: int
    size: int
    peers: Mapping[int, Tuple[str, str]]
    layout: Optional[HostLayout]   # None: no host names, every link over TCP and the flat ring only
    digest: bytes

    def problem(self) -> Optional[str]:
        """Why this view cannot form a ring (None: it can): checked before the native core sees it,
        since a view arrives over the network."""
        if not 0 <= self.rank < self.size:
            return f"rank {self.rank} outside a world of size {self.size}"
        if len(self.digest) != DIGEST_BYTES:
            return f"digest of {len(self.digest)} bytes, want {DIGEST_BYTES}"
        needed = {self.rank, (self.rank + 1) % self.size, (self.rank - 1) % self.size}
        if self.layout is not None and self.layout.num_hosts > 1 and self.layout.largest_host > 1:
            needed |= set(self.layout.neighbours(self.rank))
        missing = sorted(r for r in needed if r not in self.peers)
        if missing:
            return f"no address for rank(s) {missing[:4]}, ring neighbours of rank {self.rank}"
        bad = [r for r in self.peers if not 0 <= r < self.size]
        if bad:
            return f"rank(s) {sorted(bad)[:4]} outside a world of size {self.size}"
        return None

    @classmethod
    def of_world(cls, world) -> "RingView":
        """The view a rendezvous world gives (a ``rendezvous.client.watch_events.WorldInfo``: its
        peers, host layout and digest)."""
        layout = None
        if world.num_hosts >= 1 and world.local_size >= 1:
            layout = HostLayout(num_hosts=world.num_hosts, host=world.host_index, local_rank=world.local_rank,
                                local_size=world.local_size, first=world.rank - world.local_rank,
                                prev_leader=world.prev_leader, next_leader=world.next_leader,
                                largest_host=world.largest_host)
        # Only the ranks its rings connect to: a view may name others (rank 0, the device store's host).
        rank, size = world.rank, world.size
        ranks = {rank, (rank + 1) % size, (rank - 1) % size} if size else set()
        if layout is not None:
            ranks |= set(layout.neighbours(rank))
        peers = {m.rank: (m.ring_address, m.host) for m in world.peers if m.rank in ranks}
        return cls(rank, size, peers, layout, bytes(world.digest))

    @classmethod
    def of_full_list(cls, rank: int, addresses: Sequence[str], hosts: Optional[Sequence[str]] = None) -> "RingView":
        """The view of `rank` in the world of every rank's address (and host, if given), with the
        digest of that list. Only the ranks its rings connect to are kept."""
        size = len(addresses)
        layout = host_layout(hosts, rank) if hosts is not None else None
        ranks = {rank, (rank + 1) % size, (rank - 1) % size} if size else set()
        if layout is not None:
            ranks |= set(layout.neighbours(rank))
        peers = {r: (addresses[r], hosts[r] if hosts is not None else "") for r in sorted(ranks)}
        return cls(rank, size, peers, layout, list_digest(addresses, hosts))


def list_digest(addresses: Sequence[str], hosts: Optional[Sequence[str]] = None) -> bytes:
    """SHA-256 over every rank's address and host, in rank order: the digest of a ring formed by hand."""
    h = hashlib.sha256(b"elastic-ring full list v1\0")
    for r, a in enumerate(addresses):
        h.update(f"{r}\0{a}\0{hosts[r] if hosts is not None else ''}\n".encode())
    return h.digest()


def host_layout(hosts: Sequence[str], rank: int) -> Optional[HostLayout]:
    """The layout of `rank` from every rank's host name; None when a host's ranks are not
    contiguous (then the native core runs the flat ring only, as it does without hosts)."""
    firsts, sizes, seen = [], [], set()
    host_of_rank = 0
    for r, h in enumerate(hosts):
        if r == 0 or h != hosts[r - 1]:
            if h in seen:
                return None
            seen.add(h)
            firsts.append(r)
            sizes.append(0)
        if r == rank:
            host_of_rank = len(firsts) - 1
        sizes[-1] += 1
    if not firsts:
        return None
    n, i = len(firsts), host_of_rank
    return HostLayout(num_hosts=n, host=i, local_rank=rank - firsts[i], local_size=sizes[i], first=firsts[i],
                      prev_leader=firsts[(i - 1) % n], next_leader=firsts[(i + 1) % n], largest_host=max(sizes))
