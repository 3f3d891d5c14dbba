"""The launcher's view of the rendezvous: the embedded server process, and Status queries.

The launcher never joins a job itself; it only asks the service (the Status RPC of
protos/rendezvous.proto) which world is current, who holds which rank, and whether the job
succeeded or failed.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import grpc

from rendezvous._proto import rendezvous_pb2 as pb
from rendezvous._proto import rendezvous_pb2_grpc as pb_grpc
from rendezvous.client import open_channel

from .launch_procs import with_parent_death_signal


class RendezvousUnreachable(RuntimeError):
    """No configured server answered; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Member:
    worker_id: str
    host: str
    rank: Optional[int]        # None: on standby (not in the world)
    attached: bool
    committed_step: int


@dataclasses.dataclass(frozen=True)
class JobView:
    """One Status answer about one job."""

    job_id: str
    phase: str                 # FORMING, RUNNING, WAITING, SUCCEEDED, FAILED
    reason: str
    world_version: int
    min_np: int
    max_np: int
    elastic_timeout: float
    members: Tuple[Member, ...]

    @property
    def terminal(self) -> bool:
        return self.phase in ("SUCCEEDED", "FAILED")

    def ranks(self) -> Dict[str, int]:
        return {m.worker_id: m.rank for m in self.members if m.rank is not None}


class StatusClient:
    """Status RPCs against the configured servers, trying each in turn (any replica answers)."""

    def __init__(self, addresses: Sequence[str], token: Optional[str] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None):
        self.addresses = list(addresses)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channels = {a: open_channel(a, credentials) for a in self.addresses}
        self._stubs = {a: pb_grpc.RendezvousStub(ch) for a, ch in self._channels.items()}

    def job(self, job_id: str, timeout_s: float = 2.0) -> Optional[JobView]:
        """The job's status; None if the servers do not know it (yet). Raises RendezvousUnreachable."""
        errors = []
        for address in self.addresses:
            try:
                resp = self._stubs[address].Status(pb.StatusRequest(job_id=job_id), timeout=timeout_s,
                                                   metadata=self._metadata)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    return None
                detail = (e.details() or "").splitlines()[0] if e.details() else ""
                errors.append((f"{address}: " if len(self.addresses) > 1 else "") + e.code().name
                              + (f" ({detail})" if detail else ""))
                continue
            for j in resp.jobs:
                if j.job_id == job_id:
                    return _view(j)
            return None
        raise RendezvousUnreachable("; ".join(errors))

    def wait_reachable(self, job_id: str, timeout_s: float,
                       cancelled: Callable[[], bool] = lambda: False) -> Optional[JobView]:
        """Like job(), retrying until a server answers, the deadline passes or ``cancelled()``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.job(job_id, timeout_s=max(0.5, min(2.0, deadline - time.monotonic())))
            except RendezvousUnreachable:
                if time.monotonic() >= deadline or cancelled():
                    raise
            time.sleep(0.2)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()


def _view(j) -> JobView:
    members = tuple(Member(m.member.worker_id, m.member.host, m.member.rank if m.in_world else None,
                           m.attached, m.member.committed_step) for m in j.members)
    return JobView(j.job_id, j.phase, j.reason, j.world_version, j.spec.min_np, j.spec.max_np,
                   j.spec.elastic_timeout_s, members)


class EmbeddedServer:
    """`python -m rendezvous serve --token-file F` on 127.0.0.1 as a child process of the launcher.

    Other users of this machine reach 127.0.0.1 too: the server wants a random token (256 bits),
    written to `token_file`, mode 0600 in a private (0700) directory that `stop()` removes; only
    this launcher and the workers it points there (ELASTIC_TOKEN_FILE) can read it.
    """

    def __init__(self, port: int, elastic_timeout: float, log_line: Callable[[str], None]):
        self._dir = tempfile.mkdtemp(prefix="elastic-run-")   # 0700: only this user gets in
        self._port_file = os.path.join(self._dir, "port")
        self.token_file = os.path.join(self._dir, "token")
        self.token = secrets.token_urlsafe(32)
        try:
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.token + "\n")
            # No blacklisting: on one machine the only host would be refused after three respawns.
            self.proc = subprocess.Popen(
                with_parent_death_signal([sys.executable, "-m", "rendezvous", "serve", "--token-file",
                 self.token_file, "--host", "127.0.0.1", "--port", str(port), "--port-file", self._port_file,
                 "--elastic-timeout", f"{elastic_timeout:g}", "--blacklist-after", "1000000000",
                 "--log-level", "WARNING"]),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._last = ""
        self._reader = threading.Thread(target=self._read, args=(log_line,), daemon=True)
        self._reader.start()
        self.address = ""

    def _read(self, log_line: Callable[[str], None]) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.strip():
                self._last = line.strip()
            log_line(f"[rendezvous] {line}")

    def wait_ready(self, timeout_s: float = 30.0, cancelled: Callable[[], bool] = lambda: False) -> str:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self._port_file) and not cancelled():
            if self.proc.poll() is not None:
                self._reader.join(2)
                raise RendezvousUnreachable(f"the embedded rendezvous server exited with status "
                                            f"{self.proc.returncode}: {self._last or 'no output'}")
            if time.monotonic() > deadline:
                raise RendezvousUnreachable(f"the embedded rendezvous server did not start within {timeout_s:g} s")
            time.sleep(0.02)
        if cancelled():
            return ""
        with open(self._port_file) as f:
            self.address = f"127.0.0.1:{int(f.read())}"
        return self.address

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (graceful: streams end, nobody is evicted), then SIGKILL after the deadline."""
        if self.proc.poll() is None:
            _killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(2)
        shutil.rmtree(self._dir, ignore_errors=True)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
