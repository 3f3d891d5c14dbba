"""A throwaway certificate authority for TLS tests: a CA, and server and client certificates it signs.

Made with the `cryptography` package (test extra): EC P-256 keys, valid for a day, server
certificates for `localhost` and 127.0.0.1. Each call makes a new CA, so a second `make_pki()`
is "another CA" that the first one's peers do not trust.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class Pki:
    """Paths of PEM files: the CA certificate, a server pair, a client pair."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: str, data: bytes, mode: int = 0o644) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _issue(subject: str, key, ca_name: x509.Name, ca_key, *, usage, sans=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(ca_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage(list(usage) if isinstance(usage, (list, tuple)) else [usage]),
                        critical=False))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return b.sign(ca_key, hashes.SHA256())


def make_pki(directory: str, *, client_cn: str = "elastic-client", server_also_client: bool = False) -> Pki:
    """A new CA in `directory` with a server certificate (localhost, 127.0.0.1) and a client one.
    ``server_also_client``: the server certificate may act as a client too (as etcd's own readiness
    probe, or a certificate issued for both)."""
    os.makedirs(directory, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"elastic-ring test CA {os.urandom(4).hex()}")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_usage = ([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server_also_client
                    else ExtendedKeyUsageOID.SERVER_AUTH)
    server = _issue("localhost", server_key, ca_name, ca_key, usage=server_usage,
                    sans=(x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))))
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _issue(client_cn, client_key, ca_name, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    pem = serialization.Encoding.PEM
    return Pki(ca=_write(os.path.join(directory, "ca.pem"), ca.public_bytes(pem)),
               server_cert=_write(os.path.join(directory, "server.pem"), server.public_bytes(pem)),
               server_key=_write(os.path.join(directory, "server-key.pem"), _key_pem(server_key), 0o600),
               client_cert=_write(os.path.join(directory, "client.pem"), client.public_bytes(pem)),
               client_key=_write(os.path.join(directory, "client-key.pem"), _key_pem(client_key), 0o600))
