"""Launchers as benchmark children: start torchrun / elastic-run, and leave no process behind.

torchrun starts its workers in sessions of their own and does not take them down when it is
killed; elastic-run's die with it, but a worker could outlive a SIGKILLed launcher for a while.
So every process of a benchmark run carries one tag in its environment (BENCH_TAG), and
``Launch.close()`` ends the launcher (SIGTERM, then SIGKILL to its group after a grace) and
then SIGKILLs every process of this user whose environment still carries the tag.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

TAG_ENV = "BENCH_TAG"


def new_tag(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def tagged_pids(tag: str) -> List[int]:
    """Live processes (of this user: only theirs are readable) whose environment has BENCH_TAG=tag."""
    want = f"{TAG_ENV}={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read(1 << 20).split(b"\0")
        except OSError:
            continue
        if want in env:
            found.append(int(name))
    return found


def kill_tagged(tag: str, timeout: float = 10.0) -> None:
    """SIGKILL every process carrying ``tag`` until none is left (or ``timeout`` s passed)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = tagged_pids(tag)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if time.monotonic() > deadline:
            print(f"warning: processes {pids} (tag {tag}) still there after SIGKILL", file=sys.stderr)
            return
        time.sleep(0.05)


class Launch:
    """One launcher process with its output in a file; ``close()`` takes down everything it started."""

    def __init__(self, cmd: List[str], env: Dict[str, str], tag: str, log_path: str, cwd: Optional[str] = None):
        self.tag = tag
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=dict(env, **{TAG_ENV: tag}), cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float) -> Optional[int]:
        """Its exit status, or None when it still runs after ``timeout`` s."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def check_running(self, name: str) -> None:
        """Raises, naming ``name`` and quoting the end of its output, once the launcher has exited."""
        code = self.proc.poll()
        if code is not None:
            tail = "\n".join(self.output().splitlines()[-15:])
            raise RuntimeError(f"{name} exited with status {code} during the run:\n{tail}")

    def output(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def close(self, grace: float = 10.0) -> None:
        """SIGTERM (skipped when ``grace`` is 0), SIGKILL to the launcher's group after ``grace``
        s, then SIGKILL to every tagged process."""
        if self.proc.poll() is None:
            if grace > 0:
                try:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                except OSError:
                    pass
            if grace <= 0 or self.wait(grace) is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                self.wait(10)
        kill_tagged(self.tag)
        self._log.close()


class Watched:
    """The waits of one benchmark run: every wait re-reads the run's event logs (``logs.poll()``),
    fails as soon as ``check()`` finds a launcher of the run gone, and has a deadline."""

    name = "run"   # what messages call the run
    logs: Any      # has poll(): re-reads the workers' event logs

    def check(self) -> None:
        """Raises when something the run needs has ended (a launcher exited)."""

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """Polls ``predicate`` (the event logs re-read first) until truthy, within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            self.logs.poll()
            value = predicate()
            if value:
                return value
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no {what} within {timeout:g} s")
            time.sleep(0.05)

    def sleep_until(self, t: float) -> None:
        """Until wall-clock time ``t``, watching that the launchers still run."""
        while time.time() < t:
            self.check()
            time.sleep(min(0.1, max(0.0, t - time.time())))
