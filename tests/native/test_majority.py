"""The majority rule (elastic/ring/majority.py) as a table: who is blamed for every split of 2 to
5 ranks. Pure: no ring."""

import itertools

import pytest

from elastic.ring.majority import odd_ranks


@pytest.mark.parametrize("values, odd", [
    # 1 and 2 ranks: all agree, or no majority to trust
    ("a", ()), ("aa", ()), ("ab", None),
    # 3 ranks: 3 / 2+1 / 1+1+1
    ("aaa", ()), ("aab", (2,)), ("aba", (1,)), ("baa", (0,)), ("abc", None),
    # 4 ranks: 4 / 3+1 / 2+2 / 2+1+1 / 1+1+1+1
    ("aaaa", ()), ("aaab", (3,)), ("abaa", (1,)), ("aabb", None), ("abab", None),
    ("aabc", None), ("abca", None), ("abcd", None),
    # 5 ranks: 5 / 4+1 / 3+2 / 3+1+1 / 2+2+1 / 2+1+1+1 / 1+1+1+1+1
    ("aaaaa", ()), ("aaaab", (4,)), ("baaaa", (0,)), ("aaabb", (3, 4)), ("babaa", (0, 2)),
    ("aaabc", (3, 4)), ("acaba", (1, 3)), ("aabbc", None), ("aabcd", None), ("abcde", None),
])
def test_who_differs_from_the_majority(values, odd):
    assert odd_ranks(list(values)) == odd


@pytest.mark.parametrize("size", [3, 4, 5])
def test_every_split_blames_exactly_the_ranks_outside_a_strict_majority(size):
    for values in itertools.product("abc", repeat=size):
        counts = {v: values.count(v) for v in set(values)}
        top = max(counts.values())
        got = odd_ranks(values)
        if len(counts) == 1:
            assert got == ()
        elif 2 * top > size:
            winner = next(v for v, c in counts.items() if c == top)
            assert got == tuple(r for r, v in enumerate(values) if v != winner)
            assert len(got) < size / 2   # never more blamed than kept
        else:
            assert got is None
