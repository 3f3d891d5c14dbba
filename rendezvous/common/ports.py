"""Whether a server can listen on HOST:PORT, asked before gRPC tries.

gRPC reports a port it cannot bind with a C-core log line and a RuntimeError whose text is all
there is to tell why; a flag naming a port that is taken deserves one line naming the flag and
the port instead (`elastic-rendezvous serve --port`, `elastic-run --port`). The probe binds as
gRPC would (SO_REUSEADDR, so a port whose old connections linger in TIME_WAIT passes, as it would
for gRPC) and closes at once: a process that takes the port in between still fails in gRPC.
"""
from __future__ import annotations

import errno
import socket


def check_can_listen(host: str, port: int, flag: str) -> None:
    """ValueError naming `flag` and the port when `host:port` cannot be listened on: taken by
    another socket, or `host` not an address of this machine. Port 0 (a free one) always can."""
    if port == 0:
        return
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"{flag} {port}: cannot listen on {where}: {e.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ValueError(f"{flag} {port}: {where} is already in use") from None
                raise ValueError(f"{flag} {port}: cannot listen on {where}: {e.strerror}") from None
