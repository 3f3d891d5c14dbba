"""Worker configuration: the one place the runtime reads the environment the launcher sets.

| variable | meaning | default |
| --- | --- | --- |
| ``ELASTIC_RENDEZVOUS`` | rendezvous server(s), ``HOST:PORT[,HOST:PORT…]`` | required for ``init()`` |
| ``ELASTIC_JOB_ID`` | job id (``[A-Za-z0-9._-]``, 1-128 chars) | ``default`` |
| ``ELASTIC_WORKER_ID`` | unique worker id within the job | ``HOST-PID`` |
| ``ELASTIC_HOST`` | host name; ranks of one host are contiguous | ``socket.gethostname()`` |
| ``ELASTIC_RING_HOST`` | address this worker's ring listener binds and announces | ``127.0.0.1`` if the rendezvous is on loopback, else the host's address (which must then not be loopback) |
| ``ELASTIC_TOKEN`` / ``ELASTIC_TOKEN_FILE`` | rendezvous token (gRPC metadata) | none (insecure server) |
| ``ELASTIC_JOB_SECRET`` | secret proving ring membership | derived from token and job id |
| ``ELASTIC_MIN_NP`` / ``ELASTIC_MAX_NP`` | job size limits (first worker's win) | 1 / 1024 |
| ``ELASTIC_ELASTIC_TIMEOUT`` | seconds the job may stay below min-np | server default |
| ``ELASTIC_WORLD_TIMEOUT`` | seconds to wait for a world that includes this worker | 600 |
| ``ELASTIC_RESET_LIMIT`` | re-forms after which ``elastic.run`` gives up (0: no limit) | 0 |
| ``ELASTIC_FORM_TIMEOUT`` | seconds a ring may take to form | ``ELASTIC_WORLD_TIMEOUT`` |
| ``ELASTIC_COLLECTIVE_TIMEOUT`` etc. | ring settings, see ``elastic.CommConfig`` | |
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import os
import socket
from typing import Callable, Mapping, Optional, Sequence, Tuple

from .communicator import CommConfig


def _split_addresses(text: str) -> Tuple[str, ...]:
    out = tuple(a.strip() for a in text.split(",") if a.strip())
    for a in out:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"ELASTIC_RENDEZVOUS: {a!r} is not HOST:PORT")
    return out


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    rendezvous: Tuple[str, ...]
    job_id: str = "default"
    worker_id: str = ""
    host: str = ""
    ring_host: str = "127.0.0.1"
    token: Optional[str] = None
    job_secret: bytes = b""
    min_np: int = 1
    max_np: int = 1024
    elastic_timeout: float = 0.0
    world_timeout: float = 600.0
    reset_limit: int = 0
    comm: CommConfig = dataclasses.field(default_factory=CommConfig)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "WorkerConfig":
        env = os.environ if env is None else env
        addresses = env.get("ELASTIC_RENDEZVOUS", "")
        if not addresses:
            raise ValueError("ELASTIC_RENDEZVOUS is not set: start workers with elastic-run, or set it to the "
                             "rendezvous server's HOST:PORT")
        rendezvous = _split_addresses(addresses)
        host = env.get("ELASTIC_HOST") or socket.gethostname()
        job_id = env.get("ELASTIC_JOB_ID", "default")
        token = env.get("ELASTIC_TOKEN") or None
        token_file = env.get("ELASTIC_TOKEN_FILE")
        if token is None and token_file:
            try:
                with open(token_file) as f:
                    token = f.read().strip()
            except OSError as e:
                raise ValueError(f"ELASTIC_TOKEN_FILE={token_file!r}: {e.strerror}") from None
        secret = env.get("ELASTIC_JOB_SECRET", "").encode()
        if not secret:
            # Every worker of the job derives the same secret without another variable to pass.
            secret = hmac.new((token or "").encode(), f"elastic-ring ring secret:{job_id}".encode(),
                              hashlib.sha256).hexdigest().encode()
        ring_host = ring_host_for(env.get("ELASTIC_RING_HOST", ""), rendezvous, _host_address)

        def number(name: str, kind, default):
            raw = env.get(name, "")
            if raw == "":
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
            if value < 0:
                raise ValueError(f"{name}={raw!r} must not be negative")
            return value

        cfg = cls(
            rendezvous=rendezvous,
            job_id=job_id,
            worker_id=env.get("ELASTIC_WORKER_ID") or f"{host}-{os.getpid()}",
            host=host,
            ring_host=ring_host,
            token=token,
            job_secret=secret,
            min_np=number("ELASTIC_MIN_NP", int, 1),
            max_np=number("ELASTIC_MAX_NP", int, 1024),
            elastic_timeout=number("ELASTIC_ELASTIC_TIMEOUT", float, 0.0),
            world_timeout=number("ELASTIC_WORLD_TIMEOUT", float, 600.0),
            reset_limit=number("ELASTIC_RESET_LIMIT", int, 0),
            comm=CommConfig.from_env(env),
        )
        if env.get("ELASTIC_FORM_TIMEOUT", "") == "":
            # Forming is aborted by the rendezvous when a peer dies or the world is superseded,
            # so its own deadline is only a backstop; a newcomer may wait for the old members'
            # next commit, which can be far longer than the ring default.
            cfg = dataclasses.replace(cfg, comm=dataclasses.replace(cfg.comm, form_timeout=cfg.world_timeout))
        if cfg.min_np < 1 or cfg.max_np < cfg.min_np:
            raise ValueError(f"need 1 <= ELASTIC_MIN_NP <= ELASTIC_MAX_NP, got {cfg.min_np} and {cfg.max_np}")
        return cfg


def ring_host_for(explicit: str, rendezvous: Sequence[str], resolve: Callable[[], Tuple[str, str]]) -> str:
    """The address this worker's ring listener binds and announces (a pure decision).

    ``explicit`` is ELASTIC_RING_HOST (always wins, even a loopback one: the operator said so);
    ``rendezvous`` the server addresses; ``resolve()`` gives (host name, address it resolves
    to, "" if it does not). With every rendezvous address on loopback the job is on this host:
    127.0.0.1. Otherwise the job may span hosts, and the host's own address is announced;
    a loopback one (Debian's /etc/hosts maps the host name to 127.0.1.1) would leave the
    other hosts' workers connecting to themselves until the form timeout, so that stops
    the worker at start, naming ELASTIC_RING_HOST.
    """
    if explicit:
        return explicit
    if all(_is_loopback(a.rpartition(":")[0]) for a in rendezvous):
        return "127.0.0.1"
    name, address = resolve()
    if address and not _is_loopback(address):
        return address
    found = f"resolves to {address}, a loopback address" if address else "does not resolve"
    raise ValueError(f"ELASTIC_RING_HOST is not set and this host's name {name!r} {found}, which workers on other "
                     f"hosts cannot reach; the rendezvous ({','.join(rendezvous)}) is not on loopback, so the job "
                     "may span hosts: set ELASTIC_RING_HOST to this host's address on the network the workers "
                     "share (or to 127.0.0.1 if every worker runs on this host)")


def _host_address() -> Tuple[str, str]:
    """This host's name and the address it resolves to ("" if it does not)."""
    name = socket.gethostname()
    try:
        return name, socket.gethostbyname(name)
    except OSError:
        return name, ""
