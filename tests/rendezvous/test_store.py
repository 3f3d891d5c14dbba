"""One Store suite, run against MemoryStore and against EtcdStore on a real etcd."""
from __future__ import annotations

import pytest
import asyncio
import time

from rendezvous.server.store import Fence

from .rdzv_helpers import run_async


def test_get_missing_key_is_none(make_store, prefix):
    async def body():
        store = make_store()
        assert await store.get(prefix + "nope") is None
        await store.close()
    run_async(body())


def test_put_then_get_returns_value_and_revision(make_store, prefix):
    async def body():
        store = make_store()
        rev = await store.put(prefix + "k", b"v1")
        got = await store.get(prefix + "k")
        assert got.value == b"v1" and got.revision == rev > 0
        await store.close()
    run_async(body())


def test_compare_and_swap_applies_only_at_expected_revision(make_store, prefix):
    async def body():
        store = make_store()
        k = prefix + "cas"
        r1 = await store.put(k, b"a", expected_revision=0)         # create-if-absent
        assert r1 is not None
        assert await store.put(k, b"b", expected_revision=0) is None  # exists now
        r2 = await store.put(k, b"b", expected_revision=r1)
        assert r2 is not None and r2 > r1
        assert await store.put(k, b"c", expected_revision=r1) is None  # stale revision loses
        assert (await store.get(k)).value == b"b"
        await store.close()
    run_async(body())


def test_fence_blocks_writes_unless_fence_key_holds_value(make_store, prefix):
    async def body():
        store = make_store()
        fence = Fence(prefix + "leader", b"me")
        assert await store.put(prefix + "state", b"x", fence=fence) is None  # no leader key
        await store.put(prefix + "leader", b"other")
        assert await store.put(prefix + "state", b"x", fence=fence) is None
        assert await store.delete(prefix + "leader", fence=fence) is False
        await store.put(prefix + "leader", b"me")
        assert await store.put(prefix + "state", b"x", fence=fence) is not None
        assert await store.delete(prefix + "state", fence=fence) is True
        await store.close()
    run_async(body())


def test_get_prefix_lists_only_that_prefix(make_store, prefix):
    async def body():
        store = make_store()
        await store.put(prefix + "a/1", b"1")
        await store.put(prefix + "a/2", b"2")
        await store.put(prefix + "b/1", b"3")
        got = await store.get_prefix(prefix + "a/")
        assert {k: v.value for k, v in got.items()} == {prefix + "a/1": b"1", prefix + "a/2": b"2"}
        await store.close()
    run_async(body())


async def gone_within(store, key, timeout_s: float) -> bool:
    """Whether `key` is gone within the deadline (read every 50 ms: nothing in a Store notifies)."""
    deadline = time.monotonic() + timeout_s
    while await store.get(key) is not None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def test_a_claimed_key_holds_its_value_and_a_second_claim_is_refused(make_store, prefix):
    async def body():
        store = make_store()
        k = prefix + "leader"
        claim = await store.claim(k, b"me", ttl_s=30)
        assert claim is not None and (await store.get(k)).value == b"me"
        assert await store.claim(k, b"other", ttl_s=30) is None
        assert (await store.get(k)).value == b"me"
        await claim.release()
        await store.close()
    run_async(body())


def test_a_released_claim_frees_its_key_at_once_for_the_next(make_store, prefix):
    async def body():
        store = make_store()
        k = prefix + "leader"
        first = await store.claim(k, b"me", ttl_s=30)
        await first.release()
        assert await store.get(k) is None
        second = await store.claim(k, b"next", ttl_s=30)
        assert second is not None and (await store.get(k)).value == b"next"
        await second.release()
        await store.close()
    run_async(body())


@pytest.mark.slow
def test_a_claim_not_refreshed_lapses_and_takes_its_key_with_it(make_store, prefix):
    async def body():
        store = make_store()
        k = prefix + "leased"
        claim = await store.claim(k, b"held", ttl_s=2)
        assert await claim.refresh() is True
        assert await gone_within(store, k, 6.0), "the key outlived its claim's TTL"
        assert await claim.refresh() is False
        assert await store.claim(k, b"next", ttl_s=2) is not None
        await store.close()
    run_async(body())


def test_writes_fenced_by_a_claimed_key_apply_only_while_it_is_held(make_store, prefix):
    async def body():
        store = make_store()
        fence = Fence(prefix + "leader", b"me")
        claim = await store.claim(fence.key, b"me", ttl_s=30)
        assert await store.put(prefix + "job", b"1", fence=fence) is not None
        await claim.release()
        assert await store.put(prefix + "job", b"2", fence=fence) is None
        assert (await store.get(prefix + "job")).value == b"1"
        await store.close()
    run_async(body())


def test_delete_applies_only_at_expected_revision(make_store, prefix):
    async def body():
        store = make_store()
        k = prefix + "cad"
        r1 = await store.put(k, b"a")
        r2 = await store.put(k, b"b")
        assert await store.delete(k, expected_revision=r1) is False   # stale: someone wrote since
        assert (await store.get(k)).value == b"b"
        assert await store.delete(k, expected_revision=r2) is True
        assert await store.get(k) is None
        assert await store.delete(k, expected_revision=r2) is False   # already gone
        await store.close()
    run_async(body())


def test_a_commit_writes_and_deletes_several_keys_at_once_or_not_at_all(make_store, prefix):
    async def body():
        store = make_store()
        fence = Fence(prefix + "leader", b"me")
        await store.put(prefix + "leader", b"me")
        head = await store.commit({prefix + "j/head": b"h1", prefix + "j/w/a": b"a"}, expected={prefix + "j/head": 0},
                                  fence=fence)
        assert head is not None and (await store.get(prefix + "j/head")).revision == head
        # A stale expectation changes nothing, not even the keys it did not compare.
        assert await store.commit({prefix + "j/w/b": b"b"}, [prefix + "j/w/a"], expected={prefix + "j/head": 0},
                                  fence=fence) is None
        assert await store.get(prefix + "j/w/b") is None and await store.get(prefix + "j/w/a") is not None
        rev = await store.commit({prefix + "j/head": b"h2", prefix + "j/w/b": b"b"}, [prefix + "j/w/a"],
                                 expected={prefix + "j/head": head}, fence=fence)
        assert rev > head and await store.get(prefix + "j/w/a") is None
        await store.put(prefix + "leader", b"other")
        assert await store.commit({prefix + "j/w/c": b"c"}, fence=fence) is None
        await store.put(prefix + "leader", b"me")
        assert await store.commit({}, expected={prefix + "j/head": rev}, fence=fence,
                                  delete_prefixes=[prefix + "j/"]) is not None
        assert await store.get_prefix(prefix + "j/") == {}
        await store.close()
    run_async(body())


def test_get_prefix_returns_every_key_of_a_prefix_larger_than_a_page(make_store, prefix):
    # A job of 16,384 workers is ~6 MB of keys: read in pages, never as one message.
    from rendezvous.server.store import GET_PAGE

    async def body():
        store = make_store()
        keys = {f"{prefix}big/{i:05d}": b"v" * 100 for i in range(GET_PAGE * 2 + 7)}
        for i in range(0, len(keys), 100):
            assert await store.commit(dict(list(keys.items())[i:i + 100])) is not None
        got = await store.get_prefix(prefix + "big/")
        assert {k: v.value for k, v in got.items()} == keys
        await store.close()
    run_async(body(), 120.0)
