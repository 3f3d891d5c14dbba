"""The judgement on who called another collective (elastic.runtime.divergence), as tables: every split of 2 to 5 ranks, the ranks not judged, rows no worker writes."""

import itertools

import numpy as np
import pytest

from rendezvous.wire.membership import Blame

from elastic.ring.errors import BadPeerError, CollectiveMismatchError, FailedCall
from elastic.runtime.divergence import (DESCRIBE_BYTES, Diverged, NoMajority, Nothing, Record, decode, encode,
                                        judge, verdict_error)

ALLREDUCE = FailedCall(57, 1111, "allreduce #57 (float64, 240 elements, sum)")
OTHER = FailedCall(57, 2222, "allreduce #57 (float64, 241 elements, sum)")
THIRD = FailedCall(57, 3333, "broadcast #57 (10 bytes from rank 0)")
CALLS = [ALLREDUCE, OTHER, THIRD]


def rec(call, mismatch=False, version=4):
    return Record(version, mismatch, call)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_split_of_n_ranks_at_one_collective_has_a_majority_verdict_or_none(n):
    for split in itertools.product(range(3), repeat=n):
        # The rank after the first odd one received its segment: it says mismatch.
        records = [rec(CALLS[c], mismatch=(r > 0 and split[r - 1] != split[r])) for r, c in enumerate(split)]
        if not any(r.mismatch for r in records):
            assert judge(records, 10) == Nothing(), split
            continue
        counts = {c: split.count(c) for c in set(split)}
        top = max(counts, key=counts.get)
        verdict = judge(records, 10)
        if 2 * counts[top] > n:
            odd = tuple(r for r, c in enumerate(split) if c != top)
            assert verdict == Diverged(4, odd, CALLS[top], tuple((r, CALLS[split[r]]) for r in odd)), split
        else:
            assert verdict == NoMajority(4, tuple((r, CALLS[c]) for r, c in enumerate(split))), split


@pytest.mark.parametrize("records, verdict", [
    # nobody recorded anything, or a failure that was no mismatch: nothing to judge
    ([None, None, None], Nothing()),
    ([rec(ALLREDUCE), rec(OTHER), rec(ALLREDUCE)], Nothing()),
    # every rank called the same: the mismatch is not explained by the calls
    ([rec(ALLREDUCE, True), rec(ALLREDUCE), rec(ALLREDUCE)], Nothing()),
    # the odd rank's own mismatch flag is enough to start the judgement
    ([rec(ALLREDUCE), rec(OTHER, True), rec(ALLREDUCE)], Diverged(4, (1,), ALLREDUCE, ((1, OTHER),))),
    # a newcomer (no record) takes no part: two participants that differ have no majority
    ([rec(ALLREDUCE, True), rec(OTHER), None], NoMajority(4, ((0, ALLREDUCE), (1, OTHER)))),
    # a rank that was computing (no call) counts among the participants but is not judged:
    # 1 of 3 is no majority, and not every participant was in the collective
    ([rec(ALLREDUCE, True), rec(OTHER), rec(None)], Nothing()),
    # ... in a world of five the majority is still there without it
    ([rec(ALLREDUCE, True), rec(OTHER), rec(None), rec(ALLREDUCE), rec(ALLREDUCE)],
     Diverged(4, (1,), ALLREDUCE, ((1, OTHER),))),
    # a rank one collective further (a member died meanwhile) is not judged by another collective's call
    ([rec(ALLREDUCE, True), rec(FailedCall(58, 9, "barrier #58")), rec(ALLREDUCE)], Nothing()),
    # two at #57 with other calls, one at #58: no majority at #57, and not all at #57
    ([rec(ALLREDUCE, True), rec(OTHER), rec(FailedCall(58, 9, "barrier #58"))], Nothing()),
    # the world most ranks recorded decides; a record of an older one is stale
    ([rec(ALLREDUCE, True, version=6), rec(OTHER, True, version=3), rec(ALLREDUCE, version=6),
      rec(OTHER, version=6)], Diverged(6, (3,), ALLREDUCE, ((3, OTHER),))),
    # a record of the comparing world (10) or a later one is forged: no record
    ([rec(ALLREDUCE, True), rec(OTHER, True, version=10), rec(ALLREDUCE), rec(OTHER)],
     Diverged(4, (3,), ALLREDUCE, ((3, OTHER),))),
    ([rec(ALLREDUCE, True), rec(OTHER, True, version=2**40), rec(ALLREDUCE), rec(OTHER)],
     Diverged(4, (3,), ALLREDUCE, ((3, OTHER),))),
    # one forged record of another world cannot take the judgement away from the world most recorded
    ([rec(ALLREDUCE, True), rec(OTHER, True, version=9), rec(ALLREDUCE), rec(OTHER)],
     Diverged(4, (3,), ALLREDUCE, ((3, OTHER),))),
])
def test_verdicts(records, verdict):
    assert judge(records, 10) == verdict


def test_ties_pick_the_same_sequence_number_and_call_on_every_rank():
    a, b = FailedCall(57, 5, "a"), FailedCall(58, 4, "b")
    records = [rec(a, True), rec(b), rec(a), rec(b)]   # two at each: the lowest seq is compared
    assert judge(records, 10) == Nothing()                 # 2 of 4 at #57 is no majority; not all at #57
    assert judge(list(reversed(records)), 10) == Nothing()


def test_without_a_majority_only_the_participants_stop_and_newcomers_go_on():
    # A newcomer that forges a record at the survivor's collective can stop only that survivor
    # and itself; the honest newcomer (no record) raises nothing and goes on.
    verdict = judge([rec(ALLREDUCE, True), rec(OTHER, True), None], 10)
    assert verdict == NoMajority(4, ((0, ALLREDUCE), (1, OTHER)))
    name = lambda r: f"rank {r}"   # noqa: E731
    assert isinstance(verdict_error(verdict, 0, 10, name), CollectiveMismatchError)
    assert isinstance(verdict_error(verdict, 1, 10, name), CollectiveMismatchError)
    assert verdict_error(verdict, 2, 10, name) is None


def test_the_verdicts_errors_name_the_calls_and_blame_only_the_odd_rank():
    verdict = judge([rec(ALLREDUCE, True), rec(OTHER), rec(ALLREDUCE), None], 10)
    name = lambda r: f"worker w{r} (rank {r})"   # noqa: E731
    odd = verdict_error(verdict, 1, 10, name)
    assert isinstance(odd, CollectiveMismatchError) and odd.decided and odd.outvoted
    assert "this rank called allreduce #57 (float64, 241 elements, sum) where the majority" in str(odd)
    for rank in (0, 2, 3):   # the newcomer (3) blames it too: it sees the same rows
        err = verdict_error(verdict, rank, 10, name)
        assert isinstance(err, BadPeerError) and err.peer_rank == 1 and err.blame is Blame.DIVERGED
        assert "worker w1 (rank 1) called allreduce #57 (float64, 241 elements, sum)" in str(err)


def test_a_record_travels_as_a_fixed_row_and_comes_back_the_same():
    for record in [None, rec(ALLREDUCE, True), rec(None, False, version=9),
                   rec(FailedCall(2**32 - 1, 2**32 - 1, "x" * 10))]:
        row = encode(record)
        assert row.dtype == np.int64 and row.shape == (4 + DESCRIBE_BYTES // 8,)
        assert decode(row) == record


def test_a_long_or_odd_description_is_cut_and_never_breaks_decoding():
    long = rec(FailedCall(1, 2, "é" * 200))
    got = decode(encode(long))
    assert got.call.seq == 1 and got.call.tag == 2 and got.call.describe == "é" * (DESCRIBE_BYTES // 2)
    row = encode(rec(FailedCall(1, 2, "")))
    row[4:].view(np.uint8)[:3] = [0xFF, 0xFE, 0x41]   # not UTF-8
    assert decode(row).call.describe == "\ufffd\ufffdA"


@pytest.mark.parametrize("field, value", [(0, 0), (0, -5), (1, 2), (1, -1), (2, 2**32), (2, -2), (3, -1),
                                          (3, 2**32)])
def test_a_row_no_worker_writes_is_no_record(field, value):
    row = encode(rec(ALLREDUCE, True))
    row[field] = value
    assert decode(row) is None
