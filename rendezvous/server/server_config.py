"""The rendezvous server's configuration: one dataclass, the one home of every server setting's default.

The flags of `elastic-rendezvous serve` (rendezvous/cli.py) take their defaults from its fields, and the
membership decision's knobs are derived from it (`decision()`)."""
from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from typing import TYPE_CHECKING, Any, Optional

import grpc

from rendezvous.common.channel import is_loopback, read_pem
from rendezvous.server.decision import DecisionConfig

if TYPE_CHECKING:
    from rendezvous.server.store import EtcdAccess


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
    tls_cert: Optional[str] = None          # PEM chain served to clients; with tls_key: TLS only
    tls_key: Optional[str] = None
    tls_client_ca: Optional[str] = None     # require client certificates signed by this CA
    # etcd over TLS (a CA alone, or with a client certificate) and etcd's user/password auth.
    etcd_ca: Optional[str] = None
    etcd_cert: Optional[str] = None
    etcd_key: Optional[str] = None
    etcd_user: Optional[str] = None
    etcd_password: Optional[str] = dataclasses.field(default=None, repr=False)
    # Liveness: a client that stops answering HTTP/2 keepalive pings is cut off after at most
    # 2/3 of heartbeat_timeout_s (ping every third, wait a third for the ack); a broken stream
    # evicts at once. The acks come from gRPC's own threads, not Python's: a worker busy in Python
    # or in a long C call still answers, only a hung process (stopped, swapped out, frozen) does not.
    # 1.2 s cuts a hung worker within 0.8 s, so the survivors step again within about 1 s.
    heartbeat_timeout_s: float = 1.2
    # Membership changes arriving within settle_s of each other become one new world; under a steady
    # trickle a world still forms settle_max_s after the first change (None: 10 x settle_s, >= 2 s).
    # After an abort it forms as soon as every live member acknowledged it (decision.py).
    settle_s: float = 0.2
    settle_max_s: Optional[float] = None
    blacklist_after: int = 3                # failures that blacklist a host; 0: never
    cooldown_min_s: float = 10.0            # a blacklisting lasts this long, doubling each time,
    cooldown_max_s: float = 300.0           # up to this
    default_elastic_timeout_s: float = 600.0  # for a job whose first join leaves it 0
    leader_ttl_s: int = 2                   # etcd lease of the leader key: failover takes about this long
    # Workers registered in one job (its world and its hot spares). Neither the store (job_keys.py
    # spreads a job over keys, each write within etcd's request limits) nor Status (it lists members
    # in pages) bounds it any more; 20,480 (a world of 16,384 and a quarter more spares) is the size
    # measured (docs/benchmarks.md): the server's memory (~60 KiB a worker) and the work of each
    # world change, O(N) on one event loop, have not been measured beyond it.
    max_workers_per_job: int = 20480
    max_jobs: int = 1024                    # running jobs; finished ones do not count
    finished_job_retention_s: float = 3600.0  # then a finished job is forgotten (its id reusable)
    replica_id: str = dataclasses.field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    advertise_address: str = ""             # HOST:PORT clients should use to reach this replica
    # Prometheus /metrics on metrics_host:metrics_port (None: not served; 0: a free port). Loopback
    # by default: the metrics name every tenant's jobs and are served without auth.
    metrics_port: Optional[int] = None
    metrics_host: str = "127.0.0.1"
    events_path: Optional[str] = None       # the JSON-lines event log (None: none)

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
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert/--tls-key: client certificates are "
                             "only checked over TLS")
        etcd_flags = [flag for flag, value in (("--etcd-ca", self.etcd_ca),
                                               ("--etcd-cert", self.etcd_cert),
                                               ("--etcd-key", self.etcd_key),
                                               ("--etcd-user", self.etcd_user)) if value]
        if etcd_flags and not self.etcd_endpoints:
            raise ValueError(f"{etcd_flags[0]} needs --etcd HOST:PORT")
        if bool(self.etcd_cert) != bool(self.etcd_key):
            raise ValueError("--etcd-cert and --etcd-key must be given together")
        if self.etcd_cert and not self.etcd_ca:
            raise ValueError("--etcd-cert needs --etcd-ca: a client certificate is only presented "
                             "over TLS")
        if self.etcd_user is not None and not self.etcd_user.strip():
            raise ValueError("--etcd-user is empty")
        if self.etcd_user and not self.etcd_password:
            raise ValueError("--etcd-user needs a password: --etcd-password-file F or "
                             "ELASTIC_ETCD_PASSWORD")
        if self.etcd_password and not self.etcd_user:
            raise ValueError("an etcd password needs --etcd-user")
        if self.etcd_user and not self.etcd_ca:
            # etcd's Authenticate would carry the password in clear text, and the etcd3 client
            # sends the token it gets only over TLS (every call after it would be refused).
            raise ValueError("--etcd-user needs --etcd-ca: the etcd password is only sent over TLS")
        if not 0.5 <= self.heartbeat_timeout_s <= 600:
            raise ValueError(f"heartbeat timeout {self.heartbeat_timeout_s} s is outside 0.5..600 s")
        if not 0 <= self.settle_s <= self.effective_settle_max_s():
            raise ValueError(f"need 0 <= settle ({self.settle_s}) <= settle max "
                             f"({self.effective_settle_max_s()})")
        if self.leader_ttl_s < 1:
            raise ValueError("leader TTL must be at least 1 s")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port {self.metrics_port} is outside 0..65535")
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"--metrics-port {self.metrics_port} is also --port: give it another")
        if self.blacklist_after < 0:
            raise ValueError(f"--blacklist-after must be 0 (never) or more, got {self.blacklist_after}")

    def server_credentials(self) -> Optional[grpc.ServerCredentials]:
        """TLS credentials to serve with (None: plaintext); with a client CA, clients must present
        a certificate it signed. Reads the files: ValueError naming the flag if one is unreadable."""
        if not self.tls_cert:
            return None
        pair = (read_pem(self.tls_key, "--tls-key"), read_pem(self.tls_cert, "--tls-cert"))
        if not self.tls_client_ca:
            return grpc.ssl_server_credentials([pair])
        return grpc.ssl_server_credentials([pair], root_certificates=read_pem(
            self.tls_client_ca, "--tls-client-ca"), require_client_auth=True)

    def grpc_options(self) -> list[tuple[str, int]]:
        """The gRPC server's options. The keepalive ones follow from the heartbeat timeout T: they
        are what makes an open Watch stream the liveness signal (service.py)."""
        # Ping every T/3 and wait T/3 for the ack: a worker stopped right after an ack is cut off by
        # 2T/3, so the heartbeat timeout T holds with a third to spare for scheduling delays.
        third_ms = int(self.heartbeat_timeout_s * 1000 / 3)
        return [
            ("grpc.keepalive_time_ms", third_ms),
            ("grpc.keepalive_timeout_ms", third_ms),
            # Measured with grpcio 1.85: keepalive_timeout_ms alone never closed the connection of a
            # SIGSTOPped client; the ping ack deadline that does is this one.
            ("grpc.http2.ping_timeout_ms", third_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            # Watch streams are idle between events; without this the server stops pinging after two
            # pings without data and a stopped worker would never be detected.
            ("grpc.http2.max_pings_without_data", 0),
            # Clients ping too (to notice a dead server): accept it instead of answering GOAWAY.
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.max_receive_message_length", 1 << 20),
            ("grpc.so_reuseport", 0),
        ]

    def etcd_access(self) -> "EtcdAccess":
        from rendezvous.server.store import EtcdAccess

        return EtcdAccess(ca=self.etcd_ca, cert=self.etcd_cert, key=self.etcd_key,
                          user=self.etcd_user, password=self.etcd_password)

    def exposure_warning(self) -> Optional[str]:
        """One line for an operator when this server is reachable beyond this machine without
        protection: no token (anyone can join), or a token without TLS (it crosses in clear)."""
        if is_loopback(self.host):
            return None
        if self.insecure and not self.accepted_tokens():
            return (f"--insecure on {self.host}: anyone who can reach this address can join jobs "
                    "and act as their workers; use --token-file F (and --tls-cert/--tls-key)")
        if self.accepted_tokens() and not self.tls_cert:
            return (f"token auth without TLS on {self.host}: the token crosses the network in "
                    "clear text; add --tls-cert/--tls-key")
        return None

    def effective_settle_max_s(self) -> float:
        if self.settle_max_s is not None:
            return self.settle_max_s
        return max(2.0, 10 * self.settle_s)

    def decision(self) -> DecisionConfig:
        """The membership decision's knobs, as this configuration sets them."""
        return DecisionConfig(settle_s=self.settle_s, settle_max_s=self.effective_settle_max_s(),
                              blacklist_after=self.blacklist_after,
                              cooldown_min_s=self.cooldown_min_s, cooldown_max_s=self.cooldown_max_s)


def default(name: str) -> Any:
    """The default of ServerConfig's field `name` (what a flag left out means)."""
    field = ServerConfig.__dataclass_fields__[name]
    if field.default is dataclasses.MISSING:
        raise KeyError(f"ServerConfig.{name} has no plain default")
    return field.default
