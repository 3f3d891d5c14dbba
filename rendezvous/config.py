"""The rendezvous server's configuration: one dataclass, filled from CLI flags (rendezvous/cli.py)."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import uuid
from typing import Optional

from .decision import DecisionConfig


@dataclasses.dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 29400                       # 0: pick a free port (tests)
    etcd_endpoints: tuple[str, ...] = ()    # empty: in-memory store (single server, embedded default)
    etcd_prefix: str = "/elastic-ring"
    # Accepted in `authorization: Bearer <token>` metadata. Each job belongs to the token that
    # created it; callers with another accepted token get nothing of it. `token` is shorthand for
    # one more entry of `tokens` (tests, embedded use).
    tokens: tuple[str, ...] = ()
    token: Optional[str] = None
    insecure: bool = False                  # no tokens: anyone who can reach the server can join
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    # Liveness: a client that stops answering HTTP/2 keepalive pings is cut off after at most
    # heartbeat_timeout_s (ping every third, wait a third for the ack); a broken stream evicts at once.
    heartbeat_timeout_s: float = 3.0
    settle_s: float = 0.2
    settle_max_s: float = 2.0
    blacklist_after: int = 3
    cooldown_min_s: float = 10.0
    cooldown_max_s: float = 300.0
    default_elastic_timeout_s: float = 600.0
    leader_ttl_s: int = 2                   # etcd lease of the leader key: failover takes about this long
    # The whole job state is one etcd value: ~430 B per worker with its session hash (0.43 MiB at
    # 1,024, 1.7 MiB at 4,096, measured). etcd refuses requests over 1.5 MiB by default
    # (--max-request-bytes), so cap at 2,048 (0.9 MiB).
    max_workers_per_job: int = 2048
    max_jobs: int = 1024                    # running jobs; finished ones do not count
    finished_job_retention_s: float = 3600.0  # then a finished job is forgotten (its id reusable)
    replica_id: str = dataclasses.field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    advertise_address: str = ""             # HOST:PORT clients should use to reach this replica

    def accepted_tokens(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.tokens + ((self.token,) if self.token is not None else ())))

    def validate(self) -> None:
        tokens = self.accepted_tokens()
        if not tokens and not self.insecure:
            raise ValueError("a token is required (--token-file F), or pass --insecure to accept "
                             "unauthenticated requests")
        for i, token in enumerate(tokens, 1):
            if not token.strip():
                raise ValueError("the token is empty" if len(tokens) == 1 else f"token {i} is empty")
            if not all(0x21 <= ord(c) <= 0x7E for c in token):
                # gRPC metadata carries printable ASCII only; a space would split "Bearer <token>".
                raise ValueError(f"token {i} has characters other than printable ASCII without spaces")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if not 0.5 <= self.heartbeat_timeout_s <= 600:
            raise ValueError(f"heartbeat timeout {self.heartbeat_timeout_s} s is outside 0.5..600 s")
        if not 0 <= self.settle_s <= self.settle_max_s:
            raise ValueError(f"need 0 <= settle ({self.settle_s}) <= settle max ({self.settle_max_s})")
        if self.leader_ttl_s < 1:
            raise ValueError("leader TTL must be at least 1 s")
        if self.blacklist_after < 0:
            raise ValueError(f"--blacklist-after must be 0 (never) or more, got {self.blacklist_after}")

    def decision(self) -> DecisionConfig:
        return DecisionConfig(settle_s=self.settle_s, settle_max_s=self.settle_max_s,
                              blacklist_after=self.blacklist_after,
                              cooldown_min_s=self.cooldown_min_s, cooldown_max_s=self.cooldown_max_s)


def read_token_file(path: str) -> tuple[str, ...]:
    """The tokens in a token file: one a line (blank lines ignored), so a one-token file works as is.
    Raises ValueError naming the file when it cannot be read or holds none."""
    try:
        with open(path) as f:
            tokens = tuple(line.strip() for line in f if line.strip())
    except OSError as e:
        raise ValueError(f"cannot read token file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"token file {path} is not text") from None
    if not tokens:
        raise ValueError(f"token file {path} is empty")
    return tokens


def credential_of(token: Optional[str]) -> str:
    """What a job stores of the token that created it (SHA-256, hex); "" for no token (--insecure)."""
    return hashlib.sha256(token.encode()).hexdigest() if token else ""
