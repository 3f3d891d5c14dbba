"""Which commit a new world resumes from, and who sends which rows to whom: the resharding
decision of ``elastic.ShardedState``, as pure functions.

FSDP2 shards every parameter (and every optimizer state shaped like one) on dimension 0 with
``torch.chunk`` semantics: with ``n`` ranks, chunk ``c = ceil(rows / n)`` rows; rank ``i`` holds
rows ``[i*c, min((i+1)*c, rows))``, so the last ranks may hold fewer rows or none
(``chunk_rows``). A commit is held twice: each rank keeps its own shards (``OWN``) and sends a
copy to its buddy, the next rank round the ring (``BUDDY``). A *generation* names one such
committed layout: (commit step, world version it was taken in, that world's size).

When the world changes every rank announces what it holds (``Holding``); ``decide`` picks the
generation to resume from and ``plan`` turns (old layout, holders, new layout) into the row
ranges each new rank receives from which new rank, and from which of its copies. Only rows
that change owner move: a new rank that holds rows itself (own or buddy copy) takes them from
itself. The commit a world takes right after resharding sends each rank's new shards to its
buddy, which already holds many of those rows in its copies of the resumed generation
(``buddy_plan``): only the rest travel. Nothing here touches a socket, a tensor or a clock.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

OWN, BUDDY = 0, 1   # which copy a holder reads: its own shards of the old world, or its buddy copy


def chunk_rows(rows: int, n: int) -> List[Tuple[int, int]]:
    """The ``[start, stop)`` rows of each of ``n`` ranks, as ``torch.chunk`` (and FSDP2) split
    ``rows`` rows: equal chunks of ``ceil(rows / n)``, the last ones short or empty."""
    if n < 1 or rows < 0:
        raise ValueError(f"chunk_rows: {rows} rows over {n} ranks")
    c = -(-rows // n)
    return [(min(i * c, rows), min((i + 1) * c, rows)) for i in range(n)]


def buddy_of(rank: int, size: int) -> int:
    """The rank that keeps a copy of ``rank``'s shards: the next one round the ring."""
    return (rank + 1) % size


@dataclasses.dataclass(frozen=True, order=True)
class Generation:
    """One committed layout: commit ``step`` taken in world ``world_version`` of ``size`` ranks."""
    step: int
    world_version: int
    size: int


@dataclasses.dataclass(frozen=True)
class Holding:
    """What one rank of the new world holds: per generation, the old rank it was in it.

    ``committed`` is the generation it last promoted; ``pending`` one whose copies (own and
    buddy) it took and sent but did not see agreed (a commit cut short), or None.
    """
    committed: Optional[Tuple[Generation, int]] = None
    pending: Optional[Tuple[Generation, int]] = None

    def held(self) -> Dict[Generation, int]:
        out = {}
        for g in (self.committed, self.pending):
            if g is not None:
                out[g[0]] = g[1]
        return out


@dataclasses.dataclass(frozen=True)
class Resume:
    """Resume from ``generation``: ``holders[i]`` lists (new rank, OWN|BUDDY) holding old rank
    ``i``'s shards, the preferred first; ``root`` is a new rank holding its own copy (it sends
    the replicated part: attributes, buffers, optimizer settings)."""
    generation: Generation
    holders: Tuple[Tuple[Tuple[int, int], ...], ...]
    root: int


@dataclasses.dataclass(frozen=True)
class Lost:
    """No complete generation survives: ``missing`` are the old ranks of the newest one that
    no survivor holds (they and their buddies are gone)."""
    generation: Generation
    missing: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Fresh:
    """No rank holds any commit: the job's first world (the state comes from a durable
    commit, or from rank 0's ``build()``)."""


def decide(holdings: Sequence[Holding]) -> "Resume | Lost | Fresh":
    """The generation the new world resumes from, given what each of its ranks holds.

    A rank promotes a generation only after the commit's agreement (an allreduce every rank
    entered after its buddy copy arrived), so when any rank has promoted ``g``, every rank of
    ``g``'s world holds ``g``'s copies, promoted or pending. The newest promoted generation
    that the survivors still hold completely wins; pending ones count as holdings of it but
    are never chosen on their own (their commit may not have completed everywhere). An older
    complete generation is taken only when every newer one is incomplete.
    """
    promoted = sorted({h.committed[0] for h in holdings if h.committed is not None}, reverse=True)
    if not promoted:
        return Fresh()
    first_lost: Optional[Lost] = None
    for g in promoted:
        holders: List[List[Tuple[int, int]]] = [[] for _ in range(g.size)]
        for new_rank, h in enumerate(holdings):
            old = h.held().get(g)
            if old is None or not 0 <= old < g.size:
                continue
            holders[old].append((new_rank, OWN))
        for old in range(g.size):
            for new_rank, kind in list(holders[old]):
                if kind == OWN and g.size > 1:
                    holders[(old - 1) % g.size].append((new_rank, BUDDY))
        missing = tuple(i for i, h in enumerate(holders) if not h)
        if missing:
            first_lost = first_lost or Lost(g, missing)
            continue
        ordered = tuple(tuple(sorted(h, key=lambda x: (x[1], x[0]))) for h in holders)
        root = min(h[0][0] for h in ordered if h and h[0][1] == OWN)
        return Resume(g, ordered, root)
    return first_lost


# ---------------------------------------------------------------------- a claim nobody else holds
# What a rank says of a commit only one rank holds, from what it knows first-hand (a vote).
ABSTAIN, CONSISTENT, OBJECT = -1, 0, 1


def impossible(holdings: Sequence[Holding], world_version: int) -> Tuple[int, ...]:
    """The ranks that claim a commit taken in a world later than ``world_version``, the one
    forming now (no such world exists yet): every rank sees the same rows, so all blame them alike."""
    return tuple(r for r, h in enumerate(holdings)
                 if any(g[0].world_version > world_version for g in (h.committed, h.pending) if g is not None))


def sole_holder(decision: "Resume | Lost | Fresh") -> Optional[int]:
    """The new rank that alone holds the generation ``decision`` resumes from (no other rank
    can vouch for it), or None: several hold it, or nothing is resumed."""
    if not isinstance(decision, Resume):
        return None
    ranks = {r for holders in decision.holders for r, _ in holders}
    return next(iter(ranks)) if len(ranks) == 1 else None


def objection(claim: Generation, own: Holding, worlds: Dict[int, int], now: int) -> int:
    """This rank's vote on ``claim``, a commit another rank alone holds, from what it knows
    first-hand: the commits it holds itself (``own``) and the worlds it was in (``worlds``:
    version -> size, as the rendezvous formed them, the world ``now`` forming included).
    ``OBJECT`` when the claim contradicts that: a commit of world ``now`` while this rank took
    none in it (no rank commits in a world before the sync every rank takes part in); a world it
    was in had another size; a commit of the same world as one of its own more than one step
    apart (every rank of a world commits the same steps, one agreement apart at most) or of
    another size; or a commit of an older world than its own more than a step ahead of it (the
    newer world resumed from the newest complete commit its ranks held). ``ABSTAIN`` when it
    knows nothing (a newcomer), else ``CONSISTENT`` (which vouches for nothing)."""
    mine = [held[0] for held in (own.committed, own.pending) if held is not None]
    if claim.world_version == now and not any(g.world_version == now for g in mine):
        return OBJECT
    if not mine and not set(worlds) - {now}:
        return ABSTAIN
    if claim.world_version in worlds and worlds[claim.world_version] != claim.size:
        return OBJECT
    for g in mine:
        if g.world_version == claim.world_version and (g.size != claim.size or abs(g.step - claim.step) > 1):
            return OBJECT
        if claim.world_version < g.world_version and claim.step > g.step + 1:
            return OBJECT
    return CONSISTENT


def judge_claim(claimant: int, votes: Sequence[int]) -> bool:
    """Whether the commit ``claimant`` alone holds is refused, given every rank's ``objection``
    (the claimant's own vote is not counted). Refused when any rank objects: a commit nobody can
    vouch for is never resumed from against a witness. Whether the claimant is also blamed is
    ``blame_claimant``."""
    return any(v == OBJECT for r, v in enumerate(votes) if r != claimant)


def blame_claimant(claimant: int, votes: Sequence[int]) -> bool:
    """Whether the claimant of a refused commit is blamed (evicted): when the ranks that object
    are at least as many as those that found it consistent (who vouch for nothing, but did not
    see it contradicted). A minority of objectors is not blamed in turn: a rank that saw less
    cannot outvote one that was there; the claim is refused and nobody is evicted."""
    against = sum(1 for r, v in enumerate(votes) if r != claimant and v == OBJECT)
    consistent = sum(1 for r, v in enumerate(votes) if r != claimant and v == CONSISTENT)
    return against > 0 and against >= consistent


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Rows ``[start, stop)`` of tensor ``key``: new rank ``src`` reads them from its copy
    ``copy`` (OWN|BUDDY) of old rank ``old``'s shard and new rank ``dst`` receives them."""
    key: int
    src: int
    dst: int
    old: int
    copy: int
    start: int
    stop: int


def plan(rows: Sequence[int], old_size: int, holders: Sequence[Sequence[Tuple[int, int]]],
         new_size: int) -> List[Transfer]:
    """Every row range each new rank needs, from whom: tensor ``k`` has ``rows[k]`` rows, split
    over ``old_size`` ranks before and ``new_size`` after (``chunk_rows``); ``holders[i]`` are
    the (new rank, copy) holding old rank ``i``'s shards, preferred first. A new rank that holds
    the rows itself takes them from itself (``src == dst``: nothing moves); otherwise the first
    holder sends. Sorted by (key, dst, start): every rank computes the same list."""
    if len(holders) != old_size:
        raise ValueError(f"plan: {len(holders)} holder lists for {old_size} old ranks")
    out: List[Transfer] = []
    for key, n in enumerate(rows):
        old_chunks = chunk_rows(n, old_size)
        for dst, (a, b) in enumerate(chunk_rows(n, new_size)):
            for old, (oa, ob) in enumerate(old_chunks):
                start, stop = max(a, oa), min(b, ob)
                if start >= stop:
                    continue
                if not holders[old]:
                    raise ValueError(f"plan: old rank {old}'s shard has no holder")
                src, copy = next(((r, c) for r, c in holders[old] if r == dst), holders[old][0])
                out.append(Transfer(key, src, dst, old, copy, start, stop))
    return out


def moved_rows(transfers: Sequence[Transfer]) -> int:
    """Rows that cross between ranks (a rank's rows from itself do not count)."""
    return sum(t.stop - t.start for t in transfers if t.src != t.dst)


@dataclasses.dataclass(frozen=True)
class Hop:
    """One shift of a relay: each ``(transfer, sender)`` in ``moves`` crosses one link, from
    ``sender`` to ``sender + 1`` (``forward``) or to ``sender - 1``, in the order listed."""
    forward: bool
    moves: Tuple[Tuple[int, int], ...]


def relay(pairs: Sequence[Tuple[int, int]], size: int) -> List[Hop]:
    """The shifts that carry transfer ``i``, from rank ``pairs[i][0]`` to rank ``pairs[i][1]``
    of ``size``, the shorter way round the ring (forward on a tie), store and forward: a
    transfer ``h`` links away crosses its ``k``-th link in round ``k``. Each round is its
    forward shift, then its backward one; a shift that would move nothing on any link is left
    out, and transfers to the sender itself never travel. Every rank computes the same list,
    so what each shift sends and receives needs no description on the wire.

    A link carries only what crosses it: when a world shrinks, rows move to the rank before
    their holder, one link backwards, where a forward-only ring would take them ``size - 1``."""
    if size < 1:
        raise ValueError(f"relay: a world of {size} ranks")
    routes = []
    for i, (src, dst) in enumerate(pairs):
        if not (0 <= src < size and 0 <= dst < size):
            raise ValueError(f"relay: transfer {i} from rank {src} to rank {dst} in a world of {size}")
        if src == dst:
            continue
        ahead = (dst - src) % size
        forward = ahead <= size - ahead
        routes.append((i, src, forward, ahead if forward else size - ahead))
    out: List[Hop] = []
    for k in range(1, max((r[3] for r in routes), default=0) + 1):
        for direction in (True, False):
            step = 1 if direction else -1
            moves = tuple((i, (src + step * (k - 1)) % size) for i, src, forward, hops in routes
                          if forward == direction and hops >= k)
            if moves:
                out.append(Hop(direction, moves))
    return out


@dataclasses.dataclass(frozen=True)
class BuddyRows:
    """Rows ``[start, stop)`` of tensor ``key`` of new rank ``owner``'s shard, as its buddy gets
    them for its copy: from its own copy ``copy`` (OWN|BUDDY) of old rank ``old``'s shard, or,
    where ``old`` is None, sent by the owner."""
    key: int
    owner: int
    start: int
    stop: int
    old: Optional[int] = None
    copy: Optional[int] = None


def buddy_plan(rows: Sequence[int], old_size: int, holders: Optional[Sequence[Sequence[Tuple[int, int]]]],
               new_size: int) -> List[BuddyRows]:
    """Where each new rank's buddy takes every row of that rank's new shards from, in the commit
    taken right after resharding from the generation ``holders`` describe (as for ``plan``;
    None where no rank holds a copy: everything is sent). The buddy's copies of that generation
    are bitwise the commit the new shards were assembled from, so a row it holds there is taken
    from there; the rest is sent. Rows received during the move are not counted, so the plan
    does not depend on how the move travels. Sorted by (key, owner, start), tiling every
    owner's rows exactly; nothing for a world of one (no buddy)."""
    out: List[BuddyRows] = []
    if new_size < 2:
        return out
    if holders is not None and len(holders) != old_size:
        raise ValueError(f"buddy_plan: {len(holders)} holder lists for {old_size} old ranks")
    for key, n in enumerate(rows):
        old_chunks = chunk_rows(n, old_size)
        for owner, (a, b) in enumerate(chunk_rows(n, new_size)):
            buddy = buddy_of(owner, new_size)
            held = sorted((old_chunks[old] + (old, copy)) for old, hs in enumerate(holders or ())
                          for r, copy in hs if r == buddy)
            at = a
            for oa, ob, old, copy in held:   # a rank's copies hold distinct old chunks: disjoint
                start, stop = max(at, oa), min(b, ob)
                if start >= stop:
                    continue
                if start > at:
                    out.append(BuddyRows(key, owner, at, start))
                out.append(BuddyRows(key, owner, start, stop, old, copy))
                at = stop
            if at < b:
                out.append(BuddyRows(key, owner, at, b))
    return out


__all__ = ["OWN", "BUDDY", "chunk_rows", "buddy_of", "Generation", "Holding", "Resume", "Lost", "Fresh", "decide",
           "ABSTAIN", "CONSISTENT", "OBJECT", "impossible", "sole_holder", "objection", "judge_claim", "blame_claimant",
           "Transfer", "plan", "moved_rows", "Hop", "relay", "BuddyRows", "buddy_plan"]
