"""The embedded rendezvous server: `elastic-run` without --rendezvous runs one as its child.

The launcher never joins a job itself; it follows the job through the public Status client
(rendezvous.client.status_client.StatusClient), whichever server it talks to.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

from rendezvous.common import files, local_jobs

from elastic.launch.procs import with_parent_death_signal


EMBEDDED_HOST = "127.0.0.1"   # where it listens: only this machine reaches it


class EmbeddedServerFailed(RuntimeError):
    """The embedded server did not come up; the message is one line."""


class EmbeddedServer:
    """`python -m rendezvous serve --token-file F` on 127.0.0.1 (under srun, on the batch host's
    cluster address: elastic/launch/slurm.py) as a child process of the launcher.

    Other users of this machine reach 127.0.0.1 too: the server wants a random token (256 bits),
    written to `token_file`, mode 0600 in a private (0700) directory that `stop()` removes; only
    this launcher and the workers it points there (ELASTIC_TOKEN_FILE) can read it.
    """

    def __init__(self, port: int, elastic_timeout: float, log_line: Callable[[str], None], host: str = EMBEDDED_HOST,
                 job_id: str = ""):
        self._dir = tempfile.mkdtemp(prefix="elastic-run-")   # 0700: only this user gets in
        # Removed by stop(); this is the backstop for a launcher that ends without it (an error
        # escaping, an unhandled exit): at interpreter exit.
        atexit.register(self._remove_dir)
        self._port_file = os.path.join(self._dir, "port")
        self.token_file = os.path.join(self._dir, "token")
        self.token = secrets.token_urlsafe(32)
        try:
            files.replace(self.token_file, (self.token + "\n").encode(), mode=0o600)
            # No blacklisting for failures: on one machine the only host would be refused after
            # three respawns. A straggler's leave still cools the host down (a short first cooldown).
            self.proc = subprocess.Popen(
                with_parent_death_signal([sys.executable, "-m", "rendezvous", "serve", "--token-file",
                 self.token_file, "--host", host, "--port", str(port), "--port-file", self._port_file,
                 "--elastic-timeout", f"{elastic_timeout:g}", "--blacklist-after", "1000000000",
                 "--log-level", "WARNING"]),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        except BaseException:
            self._remove_dir()
            raise
        self._url_host = f"[{host}]" if ":" in host else host
        self._job_id = job_id
        self._announced = ""   # this job's file for `elastic-rendezvous status` (rendezvous.common.local_jobs)
        self._last = ""
        self._log_line = log_line
        self._reader = threading.Thread(target=self._read, args=(log_line,), daemon=True)
        self._reader.start()
        self.address = ""

    def _read(self, log_line: Callable[[str], None]) -> None:
        with self.proc.stderr:   # the reader owns the pipe: closed at the server's EOF
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
                raise EmbeddedServerFailed(f"the embedded rendezvous server exited with status "
                                            f"{self.proc.returncode}: {self._last or 'no output'}")
            if time.monotonic() > deadline:
                raise EmbeddedServerFailed(f"the embedded rendezvous server did not start within {timeout_s:g} s")
            time.sleep(0.02)
        if cancelled():
            return ""
        with open(self._port_file) as f:
            self.address = f"{self._url_host}:{int(f.read())}"
        self._announce()
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
        self._remove_dir()

    def _announce(self) -> None:
        """Lets `elastic-rendezvous status` on this machine, run by this user, find the job."""
        if not self._job_id:
            return
        try:
            self._announced = local_jobs.announce(local_jobs.LocalJob(self._job_id, self.address, self.token_file,
                                                                      os.getpid()))
        except OSError as e:   # status then needs --server and --token-file, as before
            self._log_line(f"elastic-run: cannot announce the job to `elastic-rendezvous status`: {e}")

    def _remove_dir(self) -> None:
        if self._announced:
            local_jobs.withdraw(self._announced)
            self._announced = ""
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self._remove_dir)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
