"""Checks of the fields a caller sends: ids, hosts, steps, ring addresses (and their name lookups).

Every check fails with INVALID_ARGUMENT naming the field and the rule. Patterns are used with
fullmatch: `$` in re.match would also accept a trailing newline.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import re
import socket
import time

import grpc

from rendezvous.server.server_wire import RpcRefusal

ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
HOST_RE = re.compile(r"[A-Za-z0-9._:\[\]-]{1,255}")
ADDR_RE = re.compile(r"[A-Za-z0-9._\-\[\]:]{1,255}:[0-9]{1,5}")
RESOLVE_TIMEOUT_S = 1.0       # a ring address's name must resolve within this (Join waits for it)
MAX_REASON = 1024


def bad(name: str, value, rule: str) -> RpcRefusal:
    shown_value = repr(value)
    if len(shown_value) > 80:
        shown_value = shown_value[:77] + "..."
    return RpcRefusal(grpc.StatusCode.INVALID_ARGUMENT, f"invalid {name} {shown_value}: expected {rule}")


def check_id(name: str, value: str) -> None:
    if not ID_RE.fullmatch(value):
        raise bad(name, value, "1..128 chars of [A-Za-z0-9._-]")


def check_host(value: str) -> None:
    if not HOST_RE.fullmatch(value):
        raise bad("host", value, "1..255 chars of [A-Za-z0-9._:[]-]")


def check_step(value: int, name: str = "commit_step") -> None:
    if value < -1:
        raise bad(name, value, ">= -1")


MAX_SCORE = 1e6


def check_straggler(score: float) -> None:
    """A straggler report's score: a finite number of times the median, 0..1e6."""
    if not 0.0 <= score <= MAX_SCORE:   # NaN fails both
        raise bad("straggler.score", score, f"a number from 0 to {MAX_SCORE:g}")


class Resolver:
    """Host-name lookups for Join, on threads of their own and bounded.

    getaddrinfo cannot be cancelled: a lookup that hangs (a name in a zone that never answers)
    keeps its thread after Join has given up on it. So each caller (credential) may have
    `per_caller` lookups in flight and all callers together at most `threads`; a Join waits up to
    the lookup timeout for a slot, then is refused RESOURCE_EXHAUSTED (retry, or announce an IP
    address), never blamed on the address, and one token's hanging names cannot hold every
    other tenant's Joins."""

    def __init__(self, threads: int = 8, per_caller: int = 2):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rdzv-resolve")
        self._threads, self._per_caller = threads, per_caller
        self._busy: dict = {}

    async def lookup(self, host: str, port: int, caller: str) -> list:
        deadline = time.monotonic() + RESOLVE_TIMEOUT_S
        while self._busy.get(caller, 0) >= self._per_caller or sum(self._busy.values()) >= self._threads:
            if time.monotonic() >= deadline:
                raise RpcRefusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"too many host-name lookups in flight to check ring address {host!r}: retry, "
                                 "or announce an IP address (ELASTIC_RING_HOST)")
            await asyncio.sleep(0.01)
        self._busy[caller] = self._busy.get(caller, 0) + 1

        def done(f):
            if not f.cancelled():
                f.exception()   # retrieved: Join may have stopped waiting for it
            left = self._busy.get(caller, 1) - 1
            if left:
                self._busy[caller] = left
            else:
                self._busy.pop(caller, None)

        fut = asyncio.get_running_loop().run_in_executor(
            self._pool, socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
        fut.add_done_callback(done)   # when the thread is done, not when Join stops waiting
        return await asyncio.wait_for(asyncio.shield(fut), RESOLVE_TIMEOUT_S)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


async def check_ring_address(address: str, resolver: Resolver, caller: str = "") -> None:
    """INVALID_ARGUMENT unless every member could connect to `address`: HOST:PORT, port
    1..65535, not a wildcard, an IP literal or a name that resolves (within a second, on
    `resolver`'s threads; `caller` is whose lookup it is). Checked at Join, once, because a bad
    address in a world would make every member's ring fail."""
    rule = "HOST:PORT with port 1..65535"
    if not ADDR_RE.fullmatch(address):
        raise bad("ring_address", address, rule)
    host, _, port_text = address.rpartition(":")
    port = int(port_text)
    if not 0 < port < 65536:
        raise bad("ring_address", address, rule)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif "[" in host or "]" in host:
        raise bad("ring_address", address, "HOST:PORT or [IPv6]:PORT")
    not_wildcard = ("an address other hosts can connect to, not a wildcard (set "
                    "ELASTIC_RING_HOST to an address of this host)")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        mapped = getattr(ip, "ipv4_mapped", None)   # ::ffff:0.0.0.0 is the IPv4 wildcard too
        if any(a is not None and (a.is_unspecified or a.is_multicast) for a in (ip, mapped)) or \
                ip == ipaddress.IPv4Address("255.255.255.255"):
            raise bad("ring_address", address, not_wildcard)
        return
    if not host:
        raise bad("ring_address", address, not_wildcard)
    try:
        infos = await resolver.lookup(host, port, caller)
    except asyncio.TimeoutError:
        raise bad("ring_address", address, f"a host name that resolves; {host} did not "
                                           f"within {RESOLVE_TIMEOUT_S:g} s") from None
    except (OSError, UnicodeError) as e:
        raise bad("ring_address", address, f"a host name that resolves; {host} does not "
                                           f"({getattr(e, 'strerror', None) or e})") from None
    addresses = {info[4][0].split("%", 1)[0] for info in infos}
    if not addresses or all(ipaddress.ip_address(a).is_unspecified for a in addresses):
        raise bad("ring_address", address, not_wildcard)
