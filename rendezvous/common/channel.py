"""How a client reaches the rendezvous service: server addresses, TLS credentials, tokens, channel
options, and the error a call ends with when it fails for good.

Every client of the service uses these: workers (worker_client.py), the launcher's Status polls and
`elastic-rendezvous status` (status_client.py), and the rendezvous server itself for its etcd
connection and its settings (server/store.py, server/server_config.py). Nothing here knows the service's messages.

TLS: `channel_credentials(ca, cert, key)` reads the PEM files once (a clear ValueError naming the
flag or variable if one is unreadable). With a CA the channel is TLS and never falls back to
plaintext, so a token sent on it only crosses TLS; a certificate and key are presented to servers
that require client certificates.
"""
from __future__ import annotations

import ipaddress
from typing import Optional, Sequence

import grpc


class RendezvousRPCError(RuntimeError):
    """A rendezvous call failed for good; `code` is the gRPC status code (None: no server reached).
    `finished` is True/False when it was refused because the job succeeded/failed, else None."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None, *,
                 finished: Optional[bool] = None):
        super().__init__(message)
        self.code = code
        self.finished = finished


class RendezvousCallAbandoned(RendezvousRPCError):
    """A call given up between two attempts because its caller asked to (its ``give_up`` event
    was set): no attempt was answered, though the last one may have reached a server."""


def channel_options(keepalive_s: float = 1.0) -> list[tuple[str, int]]:
    """gRPC channel options of a worker: ping the server every `keepalive_s` to notice a dead or
    stopped server within about 3x that and reconnect elsewhere; no transparent retries (ours
    fail over across addresses instead)."""
    return [
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_s * 2000)),
        ("grpc.http2.ping_timeout_ms", int(keepalive_s * 2000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 0),
    ]


# What a PEM file may hold at most: a long chain is a few tens of KiB; more is not a PEM file.
_PEM_MAX_BYTES = 1 << 20


def _read_bounded(path: str, what: str, limit: int, too_large: str) -> bytes:
    """At most `limit` bytes of the file at `path`; ValueError naming `what` (its flag or
    variable) when it cannot be read or is larger, `too_large` saying what it should be."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror}") from None
    if len(raw) > limit:
        raise ValueError(f"{what} {path} is larger than {limit} bytes: {too_large}")
    return raw


def read_pem(path: str, what: str) -> bytes:
    """The PEM file at `path`; ValueError naming `what` (its flag or variable) if it is unreadable,
    too large or holds no PEM block (gRPC would only fail later, at connect, without naming it)."""
    data = _read_bounded(path, what, _PEM_MAX_BYTES, "not a PEM file")
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path} is not a PEM file (no '-----BEGIN' line)")
    return data


def channel_credentials(ca: Optional[str], cert: Optional[str] = None, key: Optional[str] = None,
                        *, names: Sequence[str] = ("--tls-ca", "--tls-cert", "--tls-key")
                        ) -> Optional[grpc.ChannelCredentials]:
    """TLS credentials of a client: trust the CA certificate(s) in `ca`, and present the client
    certificate `cert` with its private key `key` when given (servers started with a client CA
    require one). None without `ca`: a plaintext channel. `names` are how the caller calls the three
    files (flags or variables), for the errors: unreadable files, a cert without its key, a client
    certificate without a CA (it would never be sent)."""
    ca_name, cert_name, key_name = names
    if not ca:
        if cert or key:
            raise ValueError(f"{cert_name if cert else key_name} needs {ca_name}: a client "
                             "certificate is only presented over TLS")
        return None
    if bool(cert) != bool(key):
        raise ValueError(f"{cert_name} and {key_name} must be given together")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, ca_name),
        private_key=read_pem(key, key_name) if key else None,
        certificate_chain=read_pem(cert, cert_name) if cert else None)


def open_channel(address: str, credentials: Optional[grpc.ChannelCredentials] = None,
                 options: Sequence[tuple[str, int]] = ()) -> grpc.Channel:
    """A channel to `address`: TLS with `credentials` (from `channel_credentials`), else plaintext."""
    if credentials is not None:
        return grpc.secure_channel(address, credentials, options=list(options))
    return grpc.insecure_channel(address, options=list(options))


def parse_addresses(text: str, what: str) -> tuple[str, ...]:
    """A comma-separated `HOST:PORT[,HOST:PORT...]` list (blanks ignored); ValueError naming `what`
    for an entry that is not HOST:PORT with a port in 1..65535, or for an empty list."""
    out = tuple(a.strip() for a in text.split(",") if a.strip())
    if not out:
        raise ValueError(f"{what} needs HOST:PORT[,HOST:PORT...]")
    for a in out:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{what}: {a!r} is not HOST:PORT")
    return out


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine only;
    wildcards (0.0.0.0, ::, empty) and other names are not."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_TOKEN_RULE = "a token is up to 4096 printable ASCII characters"


def _check_token(token: bytes, what: str, path: str) -> str:
    if len(token) > 4096 or any(b < 0x20 or b > 0x7e for b in token):
        raise ValueError(f"{what} {path} must hold tokens of up to 4096 printable ASCII characters")
    return token.decode("ascii")


def read_token_file(path: str, what: str) -> str:
    """The token in the file at `path` (surrounding whitespace dropped); ValueError naming `what`
    when it is unreadable, empty, or holds what an HTTP/2 header cannot carry."""
    token = _read_bounded(path, what, 4096, _TOKEN_RULE).strip()
    if not token:
        raise ValueError(f"{what} {path} is empty")
    return _check_token(token, what, path)


def read_token_list(path: str, what: str) -> tuple[str, ...]:
    """The tokens a server accepts: one a line, blank lines ignored, so a one-token file works
    as is. ValueError naming `what` when the file is unreadable, holds none, or a bad one."""
    lines = (line.strip() for line in _read_bounded(path, what, 1 << 20, _TOKEN_RULE).splitlines())
    tokens = tuple(dict.fromkeys(_check_token(t, what, path) for t in lines if t))
    if not tokens:
        raise ValueError(f"{what} {path} is empty")
    return tokens
