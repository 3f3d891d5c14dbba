"""One Store suite, run against MemoryStore and against EtcdStore on a real etcd."""
from __future__ import annotations

import asyncio

import pytest

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


def test_key_on_expired_lease_disappears_and_watch_sees_it(make_store, prefix):
    async def body():
        store = make_store()
        lease = await store.grant_lease(2)
        k = prefix + "leased"
        await store.put(k, b"held", lease=lease)
        watch = await store.watch(k)
        assert await store.refresh_lease(lease) is True
        assert await watch.next(timeout=6.0) is None   # deleted when the lease ran out
        assert await store.get(k) is None
        assert await store.refresh_lease(lease) is False
        watch.close()
        await store.close()
    run_async(body())


def test_revoked_lease_deletes_keys_and_watch_sees_puts_and_delete(make_store, prefix):
    async def body():
        store = make_store()
        k = prefix + "w"
        watch = await store.watch(k)
        lease = await store.grant_lease(30)
        await store.put(k, b"1", lease=lease)
        await store.put(k, b"2", lease=lease)
        await store.revoke_lease(lease)
        seen = [await watch.next(timeout=5.0) for _ in range(3)]
        assert seen == [b"1", b"2", None]
        with pytest.raises(asyncio.TimeoutError):
            await watch.next(timeout=0.2)
        watch.close()
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
