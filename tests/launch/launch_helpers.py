"""Runs `python -m elastic.launch` as a real process and watches what it prints.

Every process the launcher starts inherits a unique marker variable, so a test can list
whatever is left of a run (workers, their children, the embedded rendezvous server) by
scanning /proc/*/environ, whoever their parent is now.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import List, Optional, Sequence
from tests.waiting import wait_until  # noqa: F401  (re-exported for the tests here)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "launch", "worker.py")




def processes_with(marker: str) -> List[int]:
    """Live processes (not zombies) whose environment holds ``marker``."""
    needle = f"ELASTIC_TEST_MARKER={marker}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state != b"Z":
            found.append(int(name))
    return found


class LaunchProc:
    def __init__(self, tmp_path, *launcher_args: str, command: Optional[List[str]] = None,
                 prefix: Sequence[str] = (), launcher: Sequence[str] = (sys.executable, "-m", "elastic.launch"),
                 cwd: str = REPO, **env: str):
        """``prefix`` runs the launcher under another command (e.g. ``prlimit --nofile=…``);
        ``launcher`` is how it starts (the installed ``elastic-run``, say), in ``cwd``."""
        self.out_dir = str(tmp_path)
        self.marker = uuid.uuid4().hex
        e = dict(os.environ)
        # No empty entry: Python reads one as the working directory, which no worker command puts there.
        pythonpath = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
        e.update({"PYTHONPATH": pythonpath, "LW_OUT": self.out_dir,
                  "ELASTIC_TEST_MARKER": self.marker, "ELASTIC_WORLD_TIMEOUT": "60",
                  "ELASTIC_COLLECTIVE_TIMEOUT": "20"})
        # tests/launch/worker.py ends its job early once this file exists (``finish()``).
        self.finish_file = os.path.join(self.out_dir, f"finish-{self.marker}")
        e["LW_FINISH_AT"] = self.finish_file
        e.update({k: str(v) for k, v in env.items()})
        command = command or [sys.executable, WORKER]
        self.args = [*prefix, *launcher, *launcher_args, "--", *command]
        self.proc = subprocess.Popen(self.args, cwd=cwd, env=e, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.stdout: List[str] = []
        self.stderr: List[str] = []
        self._cond = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr), daemon=True)]
        for t in self._readers:
            t.start()

    def _read(self, pipe, lines: List[str]) -> None:
        for raw in pipe:
            with self._cond:
                lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()

    def text(self) -> str:
        with self._cond:
            return ("\n".join(self.stderr)[-5000:] + "\n--- stdout (end) ---\n" + "\n".join(self.stdout)[-1500:])

    def wait_for(self, pattern: str, timeout: float = 30.0, stream: str = "any") -> re.Match:
        """The first line (already printed or to come) matching the regex ``pattern``."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                sources = {"out": [self.stdout], "err": [self.stderr], "any": [self.stderr, self.stdout]}[stream]
                for lines in sources:
                    for line in lines:
                        m = rx.search(line)
                        if m:
                            return m
                left = deadline - time.monotonic()
                if left <= 0:
                    code = self.proc.poll()
                    raise AssertionError(f"no line matching {pattern!r} within {timeout} s; launcher "
                                         f"{'running' if code is None else f'exited {code}'}:\n{self.text()}")
                self._cond.wait(min(left, 0.1))

    def wait_training(self, size: int, timeout: float = 30.0) -> None:
        """Until tests/launch/worker.py has printed 2*size steps in a world of ``size``: its ring is
        formed and in use (a step line follows an allreduce over the whole world), not just announced."""
        rx = re.compile(rf"^\[\S+\] step \d+ size {size}$")
        wait_until(lambda: sum(1 for line in list(self.stdout) if rx.match(line)) >= 2 * size, timeout,
                   f"training in a world of {size}")

    def finish(self) -> None:
        """Ends tests/launch/worker.py's job after its next step, on every rank at the same step,
        whatever LW_STEPS says: for a test that has seen what it waited for."""
        with open(self.finish_file, "w"):
            pass

    def wait(self, timeout: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher still running after {timeout} s:\n{self.text()}") from None
        for t in self._readers:
            t.join(5)
        return code

    def worker_pid(self, worker_id: str, timeout: float = 30.0) -> int:
        path = os.path.join(self.out_dir, f"pid-{worker_id}.txt")
        wait_until(lambda: os.path.exists(path) and open(path).read().strip(), timeout, f"{worker_id} to start")
        return int(open(path).read())

    def kill_worker(self, worker_id: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.worker_pid(worker_id), sig)

    def leftovers(self) -> List[int]:
        return processes_with(self.marker)

    def wait_no_leftovers(self, timeout: float = 10.0) -> None:
        wait_until(lambda: not self.leftovers(), timeout, f"the launcher's processes to be gone: {self.leftovers()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
