"""Checks of the fields a caller sends (ids, hosts, ring addresses), and peer text made safe to show.

Every check fails with INVALID_ARGUMENT naming the field and the rule. Patterns are used with
fullmatch: `$` in re.match would also accept a trailing newline.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import re
import socket

import grpc

from .wire import RpcRefusal

ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
HOST_RE = re.compile(r"[A-Za-z0-9._:\[\]-]{1,255}")
ADDR_RE = re.compile(r"[A-Za-z0-9._\-\[\]:]{1,255}:[0-9]{1,5}")
RESOLVE_TIMEOUT_S = 1.0       # a ring address's name must resolve within this (Join waits for it)
MAX_REASON = 1024
SHOWN_CHARS = 200             # peer-supplied text is cut to this in logs and events


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


def check_step(value: int) -> None:
    if value < -1:
        raise bad("committed_step", value, ">= -1")


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """Text a peer chose, as it may appear in a log line or an event: characters that are not
    printable (newlines, terminal escapes, bidi overrides) written as escapes, at most `limit`
    characters, so it can neither forge log lines nor drive a terminal."""
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return out if len(out) <= limit else out[:limit - 3] + "..."


async def check_ring_address(address: str, resolver: concurrent.futures.Executor) -> None:
    """INVALID_ARGUMENT unless every member could connect to `address`: HOST:PORT, port
    1..65535, not a wildcard, an IP literal or a name that resolves (within a second, on
    `resolver`'s threads). Checked at Join, once, because a bad address in a world would make
    every member's ring fail."""
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
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.run_in_executor(
            resolver, socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM), RESOLVE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise bad("ring_address", address, f"a host name that resolves; {host} did not "
                                           f"within {RESOLVE_TIMEOUT_S:g} s") from None
    except (OSError, UnicodeError) as e:
        raise bad("ring_address", address, f"a host name that resolves; {host} does not "
                                           f"({getattr(e, 'strerror', None) or e})") from None
    addresses = {info[4][0].split("%", 1)[0] for info in infos}
    if not addresses or all(ipaddress.ip_address(a).is_unspecified for a in addresses):
        raise bad("ring_address", address, not_wildcard)
