"""The key-value store a world's device communicator meets over: hosted by the world's rank 0,
every value signed with the job's ring secret.

NCCL (and gloo, its stand-in on the CPU) needs a store to meet: rank 0 publishes NCCL's unique
id there and the others read it. torchrun's store lives with its agent; ours lives with the
world. Rank 0 of each world hosts a torch ``TCPStore`` on its ring address (the address every
member already reaches: no MASTER_ADDR, no port to configure) and tells the others its port and
a random nonce over the ring, which is authenticated. The store dies with the world: a new world
(rank 0 may be another worker, or gone) makes a new one. Its keys live under
``elastic/<job>/world<version>/<nonce>/``, a prefix no two worlds share, even two worlds of one
version (rings formed by hand).

A TCPStore answers whoever connects. So every value is signed: ``SignedStore`` stores
``HMAC-SHA256(key, full key name || value) || value``, with a key derived from the ring secret,
the job, the world version and the nonce, and refuses (``ForgedValueError``) a value whose MAC
does not verify. An outsider who reaches the port cannot inject a unique id or a gloo address
(it would steer ranks to its own endpoint), nor replay a value of another key or another world.
What it can still do is read values (NCCL's unique id names rank 0's bootstrap address, as under
torchrun) and disturb counters (``add``: counts cannot carry a MAC; neither NCCL nor gloo meet
through them); the worst it gets is a failed or slower meeting, never a member of its choosing.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import secrets
import socket
from typing import List, Optional, Sequence

import torch.distributed as dist

MAC_BYTES = 32
_DOMAIN = b"elastic-ring device store v1\0"


class ForgedValueError(ValueError):
    """A value in a world's device store does not carry the MAC of the job's secret: someone
    other than a member of the world wrote it (or it was moved from another key)."""


@dataclasses.dataclass(frozen=True)
class Meeting:
    """Where one world's device store is: rank 0's address, and the nonce that makes its prefix new."""

    host: str
    port: int
    nonce: bytes

    def prefix(self, job_id: str, world_version: int) -> str:
        return f"elastic/{job_id}/world{world_version}/{self.nonce.hex()}/"


def new_nonce() -> bytes:
    return secrets.token_bytes(16)


def world_key(secret: bytes, job_id: str, world_version: int, nonce: bytes) -> bytes:
    """The MAC key of one world's store: the ring secret never signs a value itself."""
    label = _DOMAIN + job_id.encode() + b"\0" + str(world_version).encode() + b"\0" + nonce
    return hmac.new(secret, label, hashlib.sha256).digest()


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SignedStore(dist.Store):
    """A torch ``Store`` over ``inner`` whose keys are under ``prefix`` and whose values are
    signed with ``key`` (see the module doc); what NCCL and gloo call goes through here."""

    def __init__(self, inner: dist.Store, key: bytes, prefix: str) -> None:
        super().__init__()
        self._inner = inner
        self._key = key
        self._prefix = prefix

    def _name(self, key: str) -> str:
        return self._prefix + key

    def _mac(self, name: str, value: bytes) -> bytes:
        return hmac.new(self._key, name.encode() + b"\0" + value, hashlib.sha256).digest()

    def sign(self, key: str, value: bytes) -> bytes:
        """What ``set(key, value)`` stores (public for the tests that forge)."""
        return self._mac(self._name(key), value) + value

    def set(self, key: str, value) -> None:
        value = _bytes(value)
        self._inner.set(self._name(key), self.sign(key, value))

    def get(self, key: str) -> bytes:
        raw = _bytes(self._inner.get(self._name(key)))
        return self.verify(key, raw)

    def verify(self, key: str, raw: bytes) -> bytes:
        """The value in ``raw`` as stored under ``key``; ``ForgedValueError`` unless its MAC verifies."""
        mac, value = raw[:MAC_BYTES], raw[MAC_BYTES:]
        if len(mac) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(self._name(key), value)):
            raise ForgedValueError(f"device store: the value of {self._name(key)!r} does not carry the job's MAC "
                                   f"({len(raw)} bytes): it was not written by a member of this world")
        return value

    def multi_get(self, keys: Sequence[str]) -> List[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def compare_set(self, key: str, expected, desired) -> bytes:
        # Only for keys set through here: the expected value is compared as stored, signed.
        expected, desired = _bytes(expected), _bytes(desired)
        signed_expected = self.sign(key, expected) if expected else b""
        got = _bytes(self._inner.compare_set(self._name(key), signed_expected, self.sign(key, desired)))
        return self.verify(key, got)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(self._name(key), amount)   # a counter: unsigned (see the module doc)

    def wait(self, keys: Sequence[str], timeout: Optional[datetime.timedelta] = None) -> None:
        names = [self._name(k) for k in keys]
        if timeout is None:
            self._inner.wait(names)
        else:
            self._inner.wait(names, timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self._inner.check([self._name(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(self._name(key))

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        return self._inner.timeout


class HostedStore:
    """The TCPStore rank 0 hosts for one world, listening on ``host`` only (its ring address)."""

    def __init__(self, host: str, timeout: datetime.timedelta) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listening = socket.socket(family, socket.SOCK_STREAM)
        try:
            listening.bind((host, 0))
            listening.listen(128)
            self.port = listening.getsockname()[1]
            self.store: Optional[dist.Store] = dist.TCPStore(
                host, self.port, None, True, timeout=timeout, wait_for_workers=False,
                master_listen_fd=listening.fileno())
        except BaseException:
            listening.close()
            raise
        listening.detach()   # the store's server owns the descriptor now, and closes it

    def close(self) -> None:
        self.store = None   # the last reference: the server stops


def connect(meeting: Meeting, timeout: datetime.timedelta) -> dist.Store:
    """A client of the store rank 0 hosts for a world."""
    return dist.TCPStore(meeting.host, meeting.port, None, False, timeout=timeout, wait_for_workers=False)


def split_host(ring_address: str) -> str:
    """The host of a ring address ``HOST:PORT`` (``[v6]:PORT`` too)."""
    host = ring_address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


__all__ = ["ForgedValueError", "HostedStore", "Meeting", "SignedStore", "connect", "new_nonce", "split_host",
           "world_key"]
