"""Where the rendezvous keeps its state: one small async `Store` interface, backed by etcd v3 or memory.

The server holds no state that the store does not, so the interface is what the server's uses need
and no more. Each member stays because something would break without it:

* `get(key)`: one key, with its revision. The journal re-reads a job after a write whose answer
  was lost or whose revision was refused; the leader hint and the campaign read the leader key.
* `get_prefix(prefix)`: every key under a prefix. A new leader loads every job at once, and a
  follower answers Status from the store; one key per job keeps writes of one job from
  contending with another's (torch elastic's backend holds one state for its one rendezvous).
* `put(key, value, expected_revision=, fence=)`: the only way state changes. Compare-and-swap on
  the revision, so two writers of one job never both win; fenced by the leader key, so a replica
  that lost leadership while paused is refused even when its revision is still the latest (it may
  not have been written since).
* `delete(key, expected_revision=, fence=)`: a finished or abandoned job leaves the store, under
  the same conditions as a write; a tombstone put instead would be loaded by every new leader
  forever.
* `commit(puts, deletes, expected=, fence=, delete_prefixes=)`: several keys in one transaction.
  A job is spread over many keys (job_keys.py) and each write touches only what changed: the
  job's head, compare-and-swap, with the changed workers' keys, atomically; and a job leaves
  the store as a whole prefix.
* `claim(key, value, ttl_s)` and the `Claim` it returns (`refresh()`, `release()`): leader
  election among replicas needs a key that disappears when its holder stops renewing it, timed
  by the store. In etcd that is a lease: its keep-alives write nothing (renewing by puts would
  add a revision to etcd's history every TTL/3, forever, unless someone compacts it), it is
  timed by etcd rather than by another replica's clock, and a crashed leader's key is gone by
  itself, so a replica started later takes over without waiting out a TTL.

No watch: its only use was a candidate waiting for the leader key to vanish, and the campaign
reads the key every TTL/8 instead (leader.py); a failover costs that much more, and etcd a read.

`MemoryStore` implements the same semantics in-process for the embedded single-server default;
tests/rendezvous/test_store.py runs one suite against both so they cannot drift. Revisions are
store-wide and strictly increasing; revision 0 means "the key does not exist", so
`put(key, value, expected_revision=0)` creates only if absent.
"""
from __future__ import annotations

import abc
import asyncio
import dataclasses
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

import grpc


GET_PAGE = 1000   # keys a page of get_prefix holds (each well under a MiB: a world chunk is ~40 KB)


class StoreError(RuntimeError):
    """The store could not be reached or answered with an error; the message names the operation."""


class EtcdAccessError(StoreError):
    """etcd refused this server's credentials (wrong user or password, no permission on the key
    prefix, auth not enabled there): trying again does not help, the configuration must change."""


@dataclasses.dataclass(frozen=True)
class EtcdAccess:
    """How the server reaches etcd: over TLS when `ca` is given (trusting it; presenting `cert`
    and `key` to an etcd started with --client-cert-auth), as etcd user `user` when given."""

    ca: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None
    user: Optional[str] = None
    password: Optional[str] = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True)
class Versioned:
    value: bytes
    revision: int       # the key's modification revision


@dataclasses.dataclass(frozen=True)
class Fence:
    """Require `key` to hold `value` for a write to apply (a leader fences its writes with its key)."""

    key: str
    value: bytes


class Store(abc.ABC):
    @abc.abstractmethod
    async def get(self, key: str) -> Optional[Versioned]: ...

    @abc.abstractmethod
    async def get_prefix(self, prefix: str) -> dict[str, Versioned]: ...

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, *, expected_revision: Optional[int] = None,
                  fence: Optional[Fence] = None) -> Optional[int]:
        """Write; return the new revision, or None if `expected_revision`/`fence` did not hold."""

    @abc.abstractmethod
    async def delete(self, key: str, *, expected_revision: Optional[int] = None,
                     fence: Optional[Fence] = None) -> bool:
        """Delete; False if the key was absent or `expected_revision`/`fence` did not hold."""

    @abc.abstractmethod
    async def commit(self, puts: Mapping[str, bytes], deletes: Sequence[str] = (), *,
                     expected: Mapping[str, int] = {}, fence: Optional[Fence] = None,   # noqa: B006 (read only)
                     delete_prefixes: Sequence[str] = ()) -> Optional[int]:
        """One transaction: every put, every delete and every key under each of `delete_prefixes`,
        only if each key of `expected` is at that revision (0: absent) and the fence holds.
        Returns the store's revision after it (0 when it changed nothing), None when refused.
        A put must not fall under a deleted prefix (etcd refuses such a transaction)."""

    @abc.abstractmethod
    async def claim(self, key: str, value: bytes, ttl_s: int) -> Optional["Claim"]:
        """Create `key` holding `value` if it is absent, for as long as the claim is refreshed
        within `ttl_s` seconds; None if the key exists (someone else holds it)."""

    async def close(self) -> None:
        return None


class Claim(abc.ABC):
    """A key held for as long as it is refreshed (Store.claim)."""

    @abc.abstractmethod
    async def refresh(self) -> bool:
        """Keep the key for another TTL; False if it already lapsed (the key is gone)."""

    @abc.abstractmethod
    async def release(self) -> None:
        """Give the key up now."""

    def blocking_refresh(self) -> Optional[Callable[[], bool]]:
        """`refresh` as a blocking call any thread may make, or None where there is none (the
        in-memory store lives on the event loop)."""
        return None


# ------------------------------------------------------------------------------------------ memory
class MemoryStore(Store):
    """In-process store with etcd's semantics (revisions, CAS, fences, claims that lapse).

    A claim is an etcd lease with one key: a put or delete of that key by other means detaches it
    (the claim lives on, holding nothing), and a claim that lapses or is released deletes the key
    only while it still holds it. Claims lapse by the monotonic `clock`, checked at every call:
    nothing in this store waits for a deletion, so nothing must happen at the instant one lapses."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._data: dict[str, Versioned] = {}
        self._rev = 0
        self._live: set["_MemoryClaim"] = set()       # claims not lapsed nor released
        self._held: dict[str, "_MemoryClaim"] = {}    # key -> the claim that holds it
        self._clock = clock

    def _expire(self) -> None:
        now = self._clock()
        for claim in [c for c in self._live if c.expiry <= now]:
            self._end(claim)

    def _end(self, claim: "_MemoryClaim") -> None:
        self._live.discard(claim)
        if self._held.get(claim.key) is claim:
            del self._held[claim.key]
            del self._data[claim.key]
            self._rev += 1

    def _fenced_out(self, fence: Optional[Fence]) -> bool:
        if fence is None:
            return False
        cur = self._data.get(fence.key)
        return cur is None or cur.value != fence.value

    async def get(self, key):
        self._expire()
        return self._data.get(key)

    async def get_prefix(self, prefix):
        self._expire()
        return {k: v for k, v in self._data.items() if k.startswith(prefix)}

    async def put(self, key, value, *, expected_revision=None, fence=None):
        self._expire()
        cur = self._data.get(key)
        if expected_revision is not None and (cur.revision if cur else 0) != expected_revision:
            return None
        if self._fenced_out(fence):
            return None
        self._held.pop(key, None)
        self._rev += 1
        self._data[key] = Versioned(bytes(value), self._rev)
        return self._rev

    async def delete(self, key, *, expected_revision=None, fence=None):
        self._expire()
        if self._fenced_out(fence) or key not in self._data:
            return False
        if expected_revision is not None and self._data[key].revision != expected_revision:
            return False
        self._held.pop(key, None)
        del self._data[key]
        self._rev += 1
        return True

    async def commit(self, puts, deletes=(), *, expected={}, fence=None, delete_prefixes=()):  # noqa: B006
        self._expire()
        for key, rev in expected.items():
            cur = self._data.get(key)
            if (cur.revision if cur else 0) != rev:
                return None
        if self._fenced_out(fence):
            return None
        gone = [k for k in self._data if k in deletes or any(k.startswith(p) for p in delete_prefixes)]
        if not puts and not gone:
            return 0
        self._rev += 1
        for k in gone:
            self._held.pop(k, None)
            del self._data[k]
        for k, v in puts.items():
            self._held.pop(k, None)
            self._data[k] = Versioned(bytes(v), self._rev)
        return self._rev

    async def claim(self, key, value, ttl_s):
        self._expire()
        if key in self._data:
            return None
        claim = _MemoryClaim(self, key, ttl_s)
        self._live.add(claim)
        self._held[key] = claim
        self._rev += 1
        self._data[key] = Versioned(bytes(value), self._rev)
        return claim


class _MemoryClaim(Claim):
    def __init__(self, store: MemoryStore, key: str, ttl_s: int):
        self._store, self.key, self._ttl_s = store, key, ttl_s
        self.expiry = store._clock() + ttl_s

    async def refresh(self):
        self._store._expire()
        if self not in self._store._live:
            return False
        self.expiry = self._store._clock() + self._ttl_s
        return True

    async def release(self):
        self._store._end(self)


# -------------------------------------------------------------------------------------------- etcd
class EtcdStore(Store):
    """etcd v3 through the `etcd3` module (blocking gRPC calls, run in worker threads).

    With `access.user`, each member's client authenticates (a round trip) when it is first used,
    so a member that is down at start costs nothing until its turn; etcd's token expires after
    its --auth-token-ttl unused, and dies with a restarted member, so a call refused with
    UNAUTHENTICATED authenticates again once and is repeated (etcd refused it before applying it,
    so a write is safe to repeat too)."""

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = 5.0,
                 access: EtcdAccess = EtcdAccess()):
        import etcd3  # imported here so the in-memory default does not need it
        import etcd3.transactions

        from rendezvous.common.channel import channel_credentials

        self._etcd3 = etcd3
        self._tx = etcd3.transactions
        if not endpoints:
            raise ValueError("EtcdStore needs at least one HOST:PORT endpoint")
        eps = []
        for ep in endpoints:
            host, sep, port = ep.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"etcd endpoint {ep!r} is not HOST:PORT")
            eps.append((host, int(port)))
        self.endpoints = list(endpoints)
        self._creds = channel_credentials(access.ca, access.cert, access.key,
                                          names=("--etcd-ca", "--etcd-cert", "--etcd-key"))
        if access.user and self._creds is None:
            raise ValueError("etcd user/password auth needs TLS (--etcd-ca): the etcd3 client "
                             "sends its token only over TLS")
        self._user, self._password = access.user, access.password
        self._timeout_s = timeout_s
        self._members = eps
        # One client per member, failover done here: etcd3's multi-endpoint client shuns a
        # failed member for 5 minutes, so with members lost one after another the store went
        # dead long after the cluster healed. Made on first use (see _client).
        self._clients: list = [None] * len(eps)
        self._member_locks = [threading.Lock() for _ in eps]
        self._current = 0
        self._switch_lock = threading.Lock()

    def _client(self, i: int):
        """Member i's client, made (and with a user, authenticated) on first use. Raises
        _NotReached when the member cannot be reached, EtcdAccessError when it refuses us."""
        with self._member_locks[i]:
            client = self._clients[i]
            if client is not None:
                return client
            host, port = self._members[i]
            # time_retry=0: a member that failed is tried again as soon as its turn comes.
            endpoint = self._etcd3.Endpoint(host, port, secure=self._creds is not None,
                                            creds=self._creds, time_retry=0)
            try:
                client = self._etcd3.MultiEndpointEtcd3Client(
                    endpoints=[endpoint], timeout=self._timeout_s, user=self._user,
                    password=self._password)
            except grpc.RpcError as e:   # only the Authenticate call makes a round trip
                endpoint.close()
                where = f"etcd member {host}:{port}"
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise _NotReached(f"{where}: {e.code().name}: {e.details()}") from None
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise EtcdAccessError(f"{where} has authentication disabled ({e.details()}): "
                                          "enable it there or drop --etcd-user") from None
                raise EtcdAccessError(f"{where} refused etcd user {self._user!r}: "
                                      f"{e.code().name}: {e.details()}") from None
            self._clients[i] = client
            return client

    def _drop(self, i: int, client) -> None:
        """Forget member i's client (its auth token is no good); the next call makes a new one."""
        with self._member_locks[i]:
            if self._clients[i] is client:
                self._clients[i] = None
        client.close()

    def _move_on(self, i: int) -> None:
        """Member i failed: the next call goes to the next member (unless another thread moved on)."""
        with self._switch_lock:
            if self._current == i:
                self._current = (i + 1) % len(self._clients)

    async def _call(self, what: str, fn, *, retry: bool = True):
        """`_call_here` in a worker thread."""
        return await asyncio.to_thread(self._call_here, what, fn, retry=retry)

    def _call_here(self, what: str, fn, *, retry: bool = True):
        """Runs `fn(client)` here, blocking. When a member answers UNAVAILABLE (it is down,
        or etcd is between leaders) the next call goes to the next member; a read or an
        idempotent call (`retry`) is also tried again there, each member once. A write is not:
        UNAVAILABLE does not prove it was not applied, so it raises (StoreError: outcome
        unknown) for the caller to settle, as after a timeout. A member that could not even be
        reached to authenticate was sent nothing: the next one is tried for writes too."""
        errors = self._etcd3.exceptions

        def attempt():
            for tried in range(1, len(self._clients) + 1):
                i = self._current
                try:
                    client = self._client(i)
                except _NotReached:
                    self._move_on(i)
                    if tried == len(self._clients):
                        raise
                    continue
                try:
                    try:
                        return fn(client)
                    except grpc.RpcError as e:
                        if e.code() != grpc.StatusCode.UNAUTHENTICATED or self._user is None:
                            raise
                        self._drop(i, client)   # token expired or unknown: authenticate again
                        return fn(self._client(i))
                except errors.ConnectionFailedError:
                    self._move_on(i)
                    if not retry or tried == len(self._clients):
                        raise
                except errors.ConnectionTimeoutError:
                    self._move_on(i)
                    raise
                except grpc.RpcError as e:
                    if e.code() in (grpc.StatusCode.PERMISSION_DENIED,
                                    grpc.StatusCode.UNAUTHENTICATED):
                        who = f"etcd user {self._user!r}" if self._user else "this client"
                        raise EtcdAccessError(
                            f"etcd {what}: {who} is refused by {self.endpoints[i]} "
                            f"({e.code().name}: {e.details()}); it needs readwrite on the key "
                            "prefix") from None
                    raise

        try:
            return attempt()
        except _NotReached as e:
            raise StoreError(f"etcd {what} failed: no member of {','.join(self.endpoints)} "
                             f"reached; last: {e}") from e
        except StoreError:
            raise
        except Exception as e:  # etcd3 raises its own ConnectionFailedError, grpc errors, …
            raise StoreError(f"etcd {what} failed against {','.join(self.endpoints)}: "
                             f"{_describe(e)}") from e

    async def verify(self, key: str) -> None:
        """Read `key` with this store's credentials, for a clear error at start: EtcdAccessError
        if etcd refuses them, StoreError if no member answers (TLS failures name their cause)."""
        await self.get(key)

    def _fence_compare(self, fence: Optional[Fence]):
        return [self._tx.Value(fence.key) == fence.value] if fence else []

    async def get(self, key):
        value, meta = await self._call(f"get {key}", lambda c: c.get(key))
        return None if value is None else Versioned(value, meta.mod_revision)

    async def get_prefix(self, prefix):
        # In pages, all at the first page's revision (one snapshot): a job of 16,384 workers is
        # ~6 MB of keys, over the 4 MiB a gRPC client takes in one message.
        import etcd3.utils
        end = etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix))
        start, revision, out = etcd3.utils.to_bytes(prefix), None, {}
        while True:
            page = await self._call(
                f"get prefix {prefix}",
                lambda c: c.get_range_response(start, end, sort_order="ascend", sort_target="key",
                                               limit=GET_PAGE, revision=revision))
            revision = revision or page.header.revision
            for kv in page.kvs:
                out[kv.key.decode()] = Versioned(kv.value, kv.mod_revision)
            if not page.more or not page.kvs:
                return out
            start = page.kvs[-1].key + b"\0"

    async def put(self, key, value, *, expected_revision=None, fence=None):
        compare = self._fence_compare(fence)
        if expected_revision is not None:
            compare.append(self._tx.Mod(key) == expected_revision)
        ok, responses = await self._call(
            f"put {key}", lambda c: c.transaction(compare=compare, success=[self._tx.Put(key, value)],
                                                  failure=[]), retry=False)
        if not ok:
            return None
        return responses[0].response_put.header.revision

    async def delete(self, key, *, expected_revision=None, fence=None):
        compare = self._fence_compare(fence)
        if expected_revision is not None:
            compare.append(self._tx.Mod(key) == expected_revision)
        ok, responses = await self._call(
            f"delete {key}", lambda c: c.transaction(compare=compare, success=[self._tx.Delete(key)], failure=[]),
            retry=False)
        return bool(ok and responses[0].response_delete_range.deleted)

    async def commit(self, puts, deletes=(), *, expected={}, fence=None, delete_prefixes=()):  # noqa: B006
        import etcd3.utils
        compare = self._fence_compare(fence)
        compare += [self._tx.Mod(k) == rev for k, rev in expected.items()]
        ops = [self._tx.Put(k, v) for k, v in puts.items()] + [self._tx.Delete(k) for k in deletes]
        ops += [self._tx.Delete(p, range_end=etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(p)))
                for p in delete_prefixes]
        ok, responses = await self._call(
            f"commit of {len(ops)} operation(s)",
            lambda c: c.transaction(compare=compare, success=ops, failure=[]), retry=False)
        if not ok:
            return None
        for r in responses:
            kind = r.WhichOneof("response")
            if kind is not None:
                return getattr(r, kind).header.revision
        return 0

    async def claim(self, key, value, ttl_s):
        lease = (await self._call(f"claim {key}: grant lease ttl={ttl_s}", lambda c: c.lease(ttl_s))).id
        claim = _EtcdClaim(self, key, lease)
        try:
            ok, _ = await self._call(
                f"claim {key}", lambda c: c.transaction(compare=[self._tx.Mod(key) == 0],
                                                        success=[self._tx.Put(key, value, lease=lease)],
                                                        failure=[]), retry=False)
        except StoreError:
            # It may have landed: revoking the lease deletes the key then. Failing that, the
            # lease lapses within its TTL, as it would after a crash here.
            try:
                await claim.release()
            except StoreError:
                pass
            raise
        if not ok:
            await claim.release()
            return None
        return claim

    async def close(self):
        def close_all():
            for c in self._clients:
                if c is not None:
                    c.close()

        await asyncio.to_thread(close_all)


class _EtcdClaim(Claim):
    """A key put with a lease of its own: refreshing keeps the lease alive, releasing revokes it."""

    def __init__(self, store: EtcdStore, key: str, lease: int):
        self._store, self.key, self._lease = store, key, lease

    async def refresh(self):
        return await asyncio.to_thread(self._refresh_here)

    def _refresh_here(self) -> bool:
        responses = self._store._call_here(f"refresh the lease of {self.key} ({self._lease:x})",
                                           lambda c: list(c.refresh_lease(self._lease)))
        return bool(responses) and responses[0].TTL > 0

    def blocking_refresh(self):
        return self._refresh_here

    async def release(self):
        await self._store._call(f"revoke the lease of {self.key} ({self._lease:x})",
                                lambda c: c.revoke_lease(self._lease))


class _NotReached(StoreError):
    """An etcd member could not be reached to authenticate (nothing was sent to it)."""


def _describe(e: BaseException) -> str:
    """An etcd3 error with the gRPC detail it hides ("etcd connection failed" says nothing of a TLS
    handshake that failed on an unknown CA, say)."""
    text = f"{type(e).__name__}: {e}"
    cause = e.__context__
    if isinstance(cause, grpc.RpcError) and not isinstance(e, grpc.RpcError):
        text += f" ({cause.code().name}: {cause.details()})"
    return text
