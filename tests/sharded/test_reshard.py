"""The resharding decision (elastic.sharded.reshard) as tables: which commit a new world resumes from,
which rows each new rank receives from whom, and which rows of its new copy a buddy holds."""

import pytest
import torch

from elastic.sharded.reshard import (BUDDY, OWN, BuddyRows, Fresh, Generation, Holding, Hop, Lost, Resume, Transfer,
                                     buddy_of, buddy_plan, chunk_rows, decide, moved_rows, plan, relay)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 7, 8, 13, 64, 100])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_chunk_rows_are_torch_chunk_with_empty_ranks_at_the_end(rows, n):
    t = torch.arange(rows)
    chunks = list(torch.chunk(t, n)) if rows else []
    chunks += [t[:0]] * (n - len(chunks))          # FSDP2's _chunk_with_empty
    got = chunk_rows(rows, n)
    assert [b - a for a, b in got] == [len(c) for c in chunks]
    assert [t[a:b].tolist() for a, b in got] == [c.tolist() for c in chunks]


G4 = Generation(step=7, world_version=3, size=4)


def h(committed=None, pending=None):
    return Holding(committed=committed, pending=pending)


@pytest.mark.parametrize("name, holdings, expected", [
    ("nobody holds a commit: the job's first world",
     [h(), h(), h()], Fresh()),
    ("one of four died: its shard is on its buddy",
     [h((G4, 0)), h((G4, 2)), h((G4, 3))],
     Resume(G4, (((0, OWN),), ((1, BUDDY),), ((1, OWN), (2, BUDDY)), ((2, OWN), (0, BUDDY))), root=0)),
    ("rank 0 of four died: rank 1 holds its copy",
     [h((G4, 1)), h((G4, 2)), h((G4, 3))],
     Resume(G4, (((0, BUDDY),), ((0, OWN), (1, BUDDY)), ((1, OWN), (2, BUDDY)), ((2, OWN),)), root=0)),
    ("two non-buddies died (0 and 2): 1 and 3 hold their copies",
     [h((G4, 1)), h((G4, 3))],
     Resume(G4, (((0, BUDDY),), ((0, OWN),), ((1, BUDDY),), ((1, OWN),)), root=0)),
    ("a buddy pair died (1 and 2): rank 1's shards are lost",
     [h((G4, 0)), h((G4, 3))], Lost(G4, (1,))),
    ("a newcomer holds nothing and is never a holder",
     [h((G4, 0)), h((G4, 1)), h((G4, 2)), h((G4, 3)), h()],
     Resume(G4, (((0, OWN), (1, BUDDY)), ((1, OWN), (2, BUDDY)), ((2, OWN), (3, BUDDY)), ((3, OWN), (0, BUDDY))),
            root=0)),
])
def test_decide(name, holdings, expected):
    assert decide(holdings) == expected, name


def test_a_commit_cut_short_resumes_from_it_when_any_rank_promoted_it():
    g8 = Generation(8, 3, 4)
    # rank 0 saw the agreement and promoted 8; the others hold 8 pending and 7 promoted.
    got = decide([h((g8, 0)), h((G4, 1), (g8, 1)), h((G4, 2), (g8, 2))])
    assert isinstance(got, Resume) and got.generation == g8
    assert got.holders[3] == ((0, BUDDY),)


def test_a_commit_no_rank_promoted_is_dropped_for_the_one_before():
    g8 = Generation(8, 3, 4)
    got = decide([h((G4, 0), (g8, 0)), h((G4, 1), (g8, 1)), h((G4, 3))])
    assert isinstance(got, Resume) and got.generation == G4


def test_the_newest_layout_of_a_step_wins_and_an_incomplete_one_falls_back_to_an_older():
    resharded = Generation(7, 4, 3)   # the same commit, taken again in the 3-rank world
    got = decide([h((resharded, 0)), h((resharded, 1)), h((resharded, 2))])
    assert got.generation == resharded
    # the 3-rank layout lost ranks 1 and 2 (buddies), but the 4-rank one is complete: take it
    got = decide([h((resharded, 0), (G4, 0)), h((G4, 1)), h((G4, 2)), h((G4, 3))])
    assert got.generation == G4


def test_the_root_is_the_lowest_new_rank_holding_its_own_copy():
    # new rank 0 is a newcomer; new rank 1 was old rank 2
    got = decide([h(), h((G4, 2)), h((G4, 3)), h((G4, 0)), h((G4, 1))])
    assert got.root == 1 and got.holders[2][0] == (1, OWN)


def test_one_rank_world_has_no_buddy():
    g1 = Generation(3, 2, 1)
    assert decide([h((g1, 0)), h()]) == Resume(g1, (((0, OWN),),), root=0)
    assert decide([h(), h()]) == Fresh()


# -------------------------------------------------------------------- plan
def own(size):
    return [((i, OWN),) for i in range(size)]


def check_covers(rows, transfers, new_size):
    """Every new rank receives exactly its chunk of every tensor, once."""
    for key, n in enumerate(rows):
        for dst, (a, b) in enumerate(chunk_rows(n, new_size)):
            got = sorted((t.start, t.stop) for t in transfers if t.key == key and t.dst == dst)
            covered = [r for s, e in got for r in range(s, e)]
            assert covered == list(range(a, b)), (key, dst, got)


@pytest.mark.parametrize("rows", [[0], [1], [5], [7, 13, 1], [64, 3]])
@pytest.mark.parametrize("old_size, new_size", [(4, 3), (3, 4), (4, 4), (1, 4), (4, 1), (5, 2), (2, 7)])
def test_plan_gives_every_new_rank_exactly_its_rows(rows, old_size, new_size):
    holders = [((i % new_size, OWN),) for i in range(old_size)]
    check_covers(rows, plan(rows, old_size, holders, new_size), new_size)


def test_same_world_moves_nothing():
    rows = [7, 13, 64]
    transfers = plan(rows, 4, own(4), 4)
    assert all(t.src == t.dst and t.copy == OWN for t in transfers)
    assert moved_rows(transfers) == 0


def test_one_of_four_lost_moves_only_what_changes_owner():
    # 12 rows: old chunks of 3 on ranks 0..3, new chunks of 4 on three. Old rank 1 died; its
    # buddy (old 2, new 1) holds its copy.
    holders = [((0, OWN),), ((1, BUDDY),), ((1, OWN),), ((2, OWN),)]
    assert plan([12], 4, holders, 3) == [
        Transfer(0, 0, 0, 0, OWN, 0, 3), Transfer(0, 1, 0, 1, BUDDY, 3, 4),
        Transfer(0, 1, 1, 1, BUDDY, 4, 6), Transfer(0, 1, 1, 2, OWN, 6, 8),
        Transfer(0, 1, 2, 2, OWN, 8, 9), Transfer(0, 2, 2, 3, OWN, 9, 12),
    ]


def test_a_holder_that_is_the_receiver_reads_its_own_copy_first():
    # old rank 0's shard is held by new 1 (own) and new 0 (buddy): new 0 takes it from itself
    holders = [((1, OWN), (0, BUDDY)), ((0, OWN),)]
    t = plan([4], 2, holders, 2)
    assert t == [Transfer(0, 0, 0, 0, BUDDY, 0, 2), Transfer(0, 0, 1, 1, OWN, 2, 4)]
    assert moved_rows(t) == 2


def test_a_shard_without_holder_is_refused():
    with pytest.raises(ValueError, match="no holder"):
        plan([8], 2, [((0, OWN),), ()], 2)


# -------------------------------------------------------------------- relay
def run_relay(pairs, size):
    """Carries every transfer along ``relay``'s hops, checking each hop sends only what its
    sender holds; returns where each transfer ended and how many hops each link carried it."""
    at = {i: src for i, (src, dst) in enumerate(pairs)}
    links = {}
    for hop in relay(pairs, size):
        senders = [sender for _, sender in hop.moves]
        for i, sender in hop.moves:
            assert at[i] == sender, (hop, i, at[i])
            to = (sender + (1 if hop.forward else -1)) % size
            links[(sender, to)] = links.get((sender, to), 0) + 1
            at[i] = to
        assert [i for i, _ in hop.moves] == sorted(i for i, _ in hop.moves), hop   # in transfer order
        assert senders, hop
    return at, links


@pytest.mark.parametrize("pairs, size, hops", [
    ([], 4, []),
    ([(0, 0), (2, 2)], 3, []),                                  # to oneself: nothing travels
    ([(1, 0), (2, 1)], 3, [Hop(False, ((0, 1), (1, 2)))]),      # a shrink: one link backwards each
    ([(0, 1), (1, 2)], 4, [Hop(True, ((0, 0), (1, 1)))]),       # a grow: one link forwards each
    ([(0, 1)], 2, [Hop(True, ((0, 0),))]),                      # two ranks: forward
    ([(1, 0)], 2, [Hop(True, ((0, 1),))]),
    ([(0, 2)], 4, [Hop(True, ((0, 0),)), Hop(True, ((0, 1),))]),  # a tie: forward, two rounds
    ([(0, 3), (3, 1)], 5, [Hop(False, ((0, 0), (1, 3))), Hop(False, ((0, 4), (1, 2)))]),   # 0 -> 4 -> 3
    ([(0, 1), (1, 0), (4, 1)], 5, [Hop(True, ((0, 0), (2, 4))), Hop(False, ((1, 1),)), Hop(True, ((2, 0),))]),
])
def test_relay_takes_each_transfer_the_shorter_way_round(pairs, size, hops):
    assert relay(pairs, size) == hops
    at, _ = run_relay(pairs, size)
    assert at == {i: dst for i, (_, dst) in enumerate(pairs)}


@pytest.mark.parametrize("old_size, new_size, lost", [(4, 3, (1,)), (4, 3, (3,)), (8, 7, (2,)), (8, 6, (1, 5)),
                                                      (3, 4, ()), (4, 8, ()), (5, 3, (1, 3)), (6, 6, (4,))])
def test_relay_of_a_reshard_delivers_every_row_and_loads_no_link_more_than_an_allgather(old_size, new_size, lost):
    # The survivors keep their order; joiners (new_size > survivors) come last, holding nothing.
    rows = [96, 7, 1]
    new_of = {old: new for new, old in enumerate(r for r in range(old_size) if r not in lost)}
    holders = [((new_of[i], OWN),) if i in new_of else ((new_of[(i + 1) % old_size], BUDDY),)
               for i in range(old_size)]
    transfers = plan(rows, old_size, holders, new_size)
    pairs = [(t.src, t.dst) for t in transfers]
    at, _ = run_relay(pairs, new_size)
    assert at == {i: t.dst for i, t in enumerate(transfers)}
    # No transfer crosses more than half the ring: at most new_size // 2 rounds of two shifts.
    assert len(relay(pairs, new_size)) <= 2 * (new_size // 2)
    # A ring allgather hands every rank all moved rows but its own; the relay hands a rank
    # only the rows it takes or passes on, which after a shrink by one rank is what it takes.
    received = {r: 0 for r in range(new_size)}
    for hop in relay(pairs, new_size):
        for i, sender in hop.moves:
            received[(sender + (1 if hop.forward else -1)) % new_size] += transfers[i].stop - transfers[i].start
    moved = moved_rows(transfers)
    for r in range(new_size):
        sent_by_r = sum(t.stop - t.start for t in transfers if t.src == r != t.dst)
        assert received[r] <= moved - sent_by_r, (r, received, moved)
    if new_size == old_size - 1 == len(new_of):
        taken = {r: sum(t.stop - t.start for t in transfers if t.dst == r != t.src) for r in range(new_size)}
        assert received == taken, (received, taken)


def test_relay_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="transfer 1 from rank 0 to rank 3 in a world of 3"):
        relay([(0, 1), (0, 3)], 3)


# -------------------------------------------------------------------- buddy_plan
def resumed(old_size, survivors):
    """decide()'s holders when old ranks ``survivors`` (in new-rank order; None: a newcomer)
    hold their commit."""
    g = Generation(10, 5, old_size)
    return decide([Holding(committed=(g, old)) if old is not None else Holding() for old in survivors]).holders


def sent_rows(pieces):
    return sum(p.stop - p.start for p in pieces if p.old is None)


def test_after_one_of_four_died_a_buddy_holds_all_but_the_rows_of_the_dead_ranks_neighbour():
    # 12 rows: old chunks of 3, new of 4. Old 3 died; old 0, 1, 2 are new 0, 1, 2. New 1 (old 1:
    # rows 3-5, and old 0's 0-2 as buddy) holds new 0's rows 0-3; new 2 holds new 1's 4-7; new 0
    # (old 0: 0-2, and old 3's 9-11 as buddy) lacks row 8 of new 2's 8-11, which alone travels.
    assert buddy_plan([12], 4, resumed(4, [0, 1, 2]), 3) == [
        BuddyRows(0, 0, 0, 3, 0, BUDDY), BuddyRows(0, 0, 3, 4, 1, OWN),
        BuddyRows(0, 1, 4, 6, 1, BUDDY), BuddyRows(0, 1, 6, 8, 2, OWN),
        BuddyRows(0, 2, 8, 9), BuddyRows(0, 2, 9, 12, 3, BUDDY),
    ]


def test_the_same_world_again_sends_no_row_and_a_newcomer_is_sent_all_of_its_neighbours():
    rows = [7, 13, 64, 2]
    assert sent_rows(buddy_plan(rows, 4, resumed(4, [0, 1, 2, 3]), 4)) == 0
    # 3 -> 4: the newcomer (new 3) holds nothing, so new 2 sends it all its rows; the others hold
    # at most part of their neighbour's
    pieces = buddy_plan([12], 3, resumed(3, [0, 1, 2, None]), 4)
    assert [p for p in pieces if p.owner == 2] == [BuddyRows(0, 2, 6, 9)]
    assert sent_rows(pieces) == 3 + 1   # of new 1's rows 3-5, new 2 (old 2: 8-11, buddy 4-7) lacks row 3


def test_without_holders_everything_is_sent_and_a_world_of_one_has_no_buddy():
    assert buddy_plan([5, 3], 2, None, 3) == [
        BuddyRows(0, 0, 0, 2), BuddyRows(0, 1, 2, 4), BuddyRows(0, 2, 4, 5),
        BuddyRows(1, 0, 0, 1), BuddyRows(1, 1, 1, 2), BuddyRows(1, 2, 2, 3)]
    assert buddy_plan([5], 2, resumed(2, [0, 1]), 1) == []


@pytest.mark.parametrize("rows", [[0], [1], [5], [7, 13, 1], [64, 3]])
@pytest.mark.parametrize("old_size, survivors, new_size",
                         [(4, [0, 1, 2], 3), (4, [1, 3], 2), (4, [2, 0, 3], 3), (3, [0, 1, 2], 4), (2, [1, 0], 5),
                          (5, [0, 2, 4], 3), (4, [0, 1, 2, 3], 4), (3, [2, 1, 0], 3)])
def test_buddy_plan_tiles_every_owners_rows_and_reads_only_what_the_buddy_holds(rows, old_size, survivors,
                                                                                 new_size):
    holders = resumed(old_size, survivors + [None] * (new_size - len(survivors)))
    pieces = buddy_plan(rows, old_size, holders, new_size)
    for key, n in enumerate(rows):
        old_chunks = chunk_rows(n, old_size)
        for owner, (a, b) in enumerate(chunk_rows(n, new_size)):
            mine = [p for p in pieces if p.key == key and p.owner == owner]
            assert [r for p in mine for r in range(p.start, p.stop)] == list(range(a, b)), (key, owner, mine)
            buddy = buddy_of(owner, new_size)
            for p in mine:
                if p.old is not None:
                    assert (buddy, p.copy) in holders[p.old]
                    oa, ob = old_chunks[p.old]
                    assert oa <= p.start < p.stop <= ob
                else:   # sent only where the buddy holds none of those rows
                    assert not any((buddy, c) in holders[old] and max(p.start, oa) < min(p.stop, ob)
                                   for old, (oa, ob) in enumerate(old_chunks) for c in (OWN, BUDDY))


# ---------------------------------------------------------------------- a commit one rank alone claims
from elastic.sharded.reshard import (ABSTAIN, CONSISTENT, OBJECT, blame_claimant, impossible,  # noqa: E402
                                     judge_claim, objection, sole_holder)

P3 = Generation(step=40, world_version=6, size=3)     # the world three members were in together
FORGED = Generation(step=10 ** 9, world_version=6, size=1)


NOW = 9   # the world forming


@pytest.mark.parametrize("name, claim, own, worlds, vote", [
    ("a newcomer knows nothing", FORGED, h(), {}, ABSTAIN),
    ("a newcomer knows only the world forming now", FORGED, h(), {NOW: 4}, ABSTAIN),
    ("a commit of the world forming now, which nobody has committed in", Generation(10 ** 9, NOW, 1), h(),
     {NOW: 4}, OBJECT),
    ("the same, to a member of an older world", Generation(10 ** 9, NOW, 2), h((P3, 1)), {6: 3, NOW: 2}, OBJECT),
    ("a commit of this world, one step from this rank's own in it (a sync inside the world)",
     Generation(51, NOW, 2), h((Generation(50, NOW, 2), 1)), {NOW: 2}, CONSISTENT),
    ("a one-rank commit of the three-rank world this rank was in", FORGED, h((P3, 1)), {6: 3}, OBJECT),
    ("the same, known only from the commit it holds", FORGED, h((P3, 1)), {}, OBJECT),
    ("the same, known only from the world it was in", FORGED, h(), {6: 3}, OBJECT),
    ("the right size, but 10^9 steps past this world's commits", Generation(10 ** 9, 6, 3), h((P3, 1)), {6: 3},
     OBJECT),
    ("one agreement ahead in the same world (a commit cut short here)", Generation(41, 6, 3), h((P3, 1)), {6: 3},
     CONSISTENT),
    ("an older world, far ahead of the commit this rank's newer world took", Generation(500, 4, 1),
     h((P3, 1)), {4: 2, 6: 3}, OBJECT),
    ("an older world, behind this rank's commit", Generation(30, 4, 1), h((P3, 1)), {6: 3}, CONSISTENT),
    ("a newer world this rank was not in: a lone worker trained on", Generation(90, 8, 1), h((P3, 1)), {6: 3},
     CONSISTENT),
    ("a newer world this rank was in, of another size", Generation(90, 8, 1), h((P3, 1)), {6: 3, 8: 2}, OBJECT),
    ("a buddy-pair survivor's two-rank commit, to a rank of an older world", Generation(60, 7, 2), h((P3, 1)),
     {6: 3}, CONSISTENT),
])
def test_objection(name, claim, own, worlds, vote):
    assert objection(claim, own, worlds, NOW) == vote


# votes by rank; the claimant (rank 0) is never counted
@pytest.mark.parametrize("votes, refused, blamed", [
    # nobody contradicts it: a lone worker joined by newcomers, or witnesses that saw nothing wrong
    ([ABSTAIN, ABSTAIN, ABSTAIN], False, False),
    ([ABSTAIN, CONSISTENT, ABSTAIN], False, False),
    ([OBJECT, CONSISTENT, CONSISTENT], False, False),           # its own vote does not count
    # splits of 3 ranks (the claimant and two others)
    ([ABSTAIN, OBJECT, OBJECT], True, True),
    ([ABSTAIN, OBJECT, CONSISTENT], True, True),                 # 1 against 1: the objector is believed
    ([ABSTAIN, OBJECT, ABSTAIN], True, True),                    # the only witness objects
    # splits of 4
    ([ABSTAIN, OBJECT, OBJECT, ABSTAIN], True, True),
    ([ABSTAIN, OBJECT, CONSISTENT, CONSISTENT], True, False),    # a minority: refused, nobody evicted
    ([ABSTAIN, OBJECT, OBJECT, CONSISTENT], True, True),
    # splits of 5
    ([ABSTAIN, OBJECT, OBJECT, CONSISTENT, CONSISTENT], True, True),
    ([ABSTAIN, OBJECT, CONSISTENT, CONSISTENT, CONSISTENT], True, False),
    ([ABSTAIN, OBJECT, OBJECT, OBJECT, CONSISTENT], True, True),
    ([ABSTAIN, ABSTAIN, ABSTAIN, ABSTAIN, OBJECT], True, True),
])
def test_judge_claim_and_blame(votes, refused, blamed):
    assert judge_claim(0, votes) is refused
    assert blame_claimant(0, votes) is blamed


def test_a_forged_one_rank_commit_wins_decide_alone_and_is_the_only_one_judged():
    # Three members of world 6 and a newcomer; rank 1 forges a complete one-rank commit.
    holdings = [h((P3, 0)), h((FORGED, 0)), h((P3, 2)), h()]
    decision = decide(holdings)
    assert decision.generation == FORGED and decision.root == 1 and sole_holder(decision) == 1
    votes = [objection(FORGED, holdings[r], {6: 3, 7: 4}, 7) if r != 1 else ABSTAIN for r in range(3)] + [ABSTAIN]
    assert votes == [OBJECT, ABSTAIN, OBJECT, ABSTAIN]
    assert judge_claim(1, votes) and blame_claimant(1, votes)
    # Without the claim the world resumes from what the others hold together.
    again = decide([Holding() if r == 1 else x for r, x in enumerate(holdings)])
    assert again.generation == P3 and sole_holder(again) is None


def test_legitimate_single_holders_are_not_judged_against():
    lone = Generation(90, 8, 1)
    assert sole_holder(decide([h((lone, 0)), h(), h()])) == 0   # a lone worker joined by two newcomers
    assert [objection(lone, x, {9: 3}, 9) for x in (h(), h())] == [ABSTAIN, ABSTAIN]
    pair = Generation(12, 5, 2)   # a buddy pair's survivor holds both shards: own and the other's copy
    assert sole_holder(decide([h((pair, 1)), h()])) == 0
    assert sole_holder(decide([h((P3, 0)), h((P3, 1)), h((P3, 2))])) is None
    assert sole_holder(Fresh()) is None and sole_holder(Lost(P3, (1,))) is None


@pytest.mark.parametrize("holdings, version, liars", [
    ([h((P3, 0)), h((P3, 1))], 7, ()),
    ([h((P3, 0)), h((Generation(5, 7, 1), 0))], 7, ()),           # of the world forming now: put to the vote
    ([h((P3, 0)), h((Generation(5, 8, 1), 0))], 7, (1,)),         # a commit of a world not formed yet
    ([h((P3, 0), (Generation(5, 9, 2), 0)), h((P3, 1))], 7, (0,)),  # a pending one of a later world
    ([h(), h()], 1, ()),
])
def test_impossible_claims(holdings, version, liars):
    assert impossible(holdings, version) == liars
