"""A forked child of a worker (a DataLoader's workers) lets go of the worker's rendezvous connections.

A forked child inherits every descriptor of the worker. While a child holds the worker's gRPC
connection, a SIGKILLed worker's Watch stream stays open: the server learns of the death only from
missed keepalive pings (the heartbeat timeout), not at once, and the job re-forms that much later.
The ring's own sockets are let go of by the native core (``native/src/transport/fork_guard.h``); this does the
same for the sockets connected to the rendezvous servers, which gRPC's C core owns and does not
name. In the child each such socket is replaced by ``/dev/null``: the connection stays the
worker's alone, and the number stays taken, so the child can neither close nor write to a
descriptor of its own by mistake. (gRPC cannot be used in a forked child anyway: workers run with
its fork support off, ``elastic.launch.procs.WORKER_DEFAULTS``.)

The sockets are found without touching them: ``/proc/self/net/tcp`` and ``tcp6`` name each
connection's peer and inode, and a descriptor is one of them when ``fstat`` gives that inode
(wrapping a foreign descriptor in a Python socket could change its blocking mode, which the
worker shares). Only forks that run Python's fork hooks are covered (``os.fork``, multiprocessing,
a DataLoader); a fork from C code is not. Server names are resolved when the session starts; a
server reached through a proxy is not recognized (its connection's peer is the proxy).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import struct
import sys
import threading
from typing import Dict, Iterable, Optional, Set, Tuple

Peer = Tuple[str, int]


def peer_key(host: str, port: int) -> Optional[Peer]:
    """How a server's endpoint is compared with a connection's peer: its IP address in one
    spelling (an IPv4-mapped IPv6 address as the IPv4 one, no zone) and its port; None for what
    is not an IP address."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port)


def connections(table: str, byteorder: str = sys.byteorder) -> Dict[int, Peer]:
    """The peers of the connections in a ``/proc/net/tcp`` or ``tcp6`` table, by socket inode
    (listening sockets, whose peer is the unspecified address, and malformed lines left out).
    The kernel prints each 32-bit word of an address as the number it is in memory: ``byteorder``
    is that of the machine the table comes from."""
    word = "<I" if byteorder == "little" else ">I"
    out: Dict[int, Peer] = {}
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        address, _, port = fields[2].partition(":")
        try:
            if len(address) not in (8, 32) or len(port) != 4:
                continue
            raw = b"".join(struct.pack(word, int(address[i:i + 8], 16)) for i in range(0, len(address), 8))
            key = peer_key(str(ipaddress.ip_address(raw)), int(port, 16))
            inode = int(fields[9])
        except (ValueError, struct.error):
            continue
        if key is not None and inode > 0 and not ipaddress.ip_address(key[0]).is_unspecified:
            out[inode] = key
    return out


class RendezvousGuard:
    """The rendezvous servers a session reaches, let go of in every child forked while it is
    ``active``; the session holds it and ``release()``s it when it ends."""

    def __init__(self, peers: Set[Peer]):
        self.peers = frozenset(peers)
        self.active = True
        # The lock is held across the fork, so a child never inherits it taken.
        self._lock = threading.Lock()
        os.register_at_fork(before=self._lock.acquire, after_in_parent=self._lock.release,
                            after_in_child=self._in_child)

    def release(self) -> None:
        with self._lock:
            self.active = False

    def _in_child(self) -> None:
        self._lock.release()
        if self.active:
            self.active = False   # the child has no session of its own
            let_go(set(self.peers))


def guard_rendezvous(addresses: Iterable[str]) -> RendezvousGuard:
    """Makes children forked from now on (until the guard is released) let go of their inherited
    connections to these rendezvous servers ("host:port" each; names are resolved here, in the
    worker, never in the child)."""
    found = set()
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError, UnicodeError):
            continue   # the client reports an unusable address itself, when it tries it
        found |= {k for k in (peer_key(info[4][0], info[4][1]) for info in infos) if k is not None}
    return RendezvousGuard(found)


def let_go(peers: Set[Peer]) -> None:
    """Replaces every descriptor of this process that is a TCP connection to one of ``peers``
    with /dev/null."""
    inodes = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                inodes |= {inode for inode, peer in connections(f.read()).items() if peer in peers}
        except OSError:
            continue   # no IPv6 here, or no /proc
    if not inodes:
        return
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    null = -1
    try:
        for name in names:
            try:
                st = os.fstat(int(name))
            except (OSError, ValueError):
                continue
            if stat.S_ISSOCK(st.st_mode) and st.st_ino in inodes:
                if null < 0:
                    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
                os.dup2(null, int(name), inheritable=False)
    finally:
        if null >= 0:
            os.close(null)
