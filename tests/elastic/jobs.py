"""Runs tests/elastic/job.py as real worker processes against a real rendezvous server.

Workers are forked from one fork server per test session (elastic-run --preload's, with torch
imported once), as `elastic-run --preload torch` starts them: a new Python importing torch costs
seconds of CPU per worker, and the suite starts hundreds. They are real processes all the same:
their own pid, session and sockets, killed and stopped with real signals. A worker run under a
command prefix (a network namespace), or of a job made with ``forked=False``, starts as a new process.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, Optional, Sequence, Union

from elastic.launch.forkserver import ForkedProcess, ForkServer
from tests.waiting import wait_until  # noqa: F401  (re-exported for the tests here)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "tests", "elastic", "job.py")
# torch._dynamo: what each worker's first optimizer imports (torch.optim loads it lazily), 1.6 s of CPU.
PRELOAD = ("torch", "torch._dynamo")

_server: Optional[ForkServer] = None
_server_lock = threading.Lock()


def _pythonpath() -> str:
    # No empty entry: Python reads one as the working directory.
    return os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)


def fork_server() -> ForkServer:
    """The session's fork server, started at first use with this process's environment: what
    Python and torch read as they start (PYTHONPATH, OMP_NUM_THREADS, ...) is the server's for
    every worker, so a variable of that kind set for one worker does not reach it. The tests set
    none; their own variables, read at run time, travel with each request."""
    global _server
    with _server_lock:
        if _server is None or _server.dead:
            _server = ForkServer(PRELOAD, dict(os.environ, PYTHONPATH=_pythonpath()), command=[sys.executable, JOB])
            atexit.register(_server.close)
        _server.wait_ready(timeout_s=120)
        return _server


class Job:
    def __init__(self, tmp_path, server_address: str, *, job_id: str = "job", min_np: int = 1, max_np: int = 8,
                 script: str = JOB, forked: bool = True, **env: str):
        """``forked=False``: every worker starts as a new Python that imports torch itself, as
        under a plain elastic-run (bench/chaos_soak.py measures that)."""
        self.out = str(tmp_path)
        self.script = script
        self.forked = forked
        self.env = dict(os.environ)
        self.env.update({
            "PYTHONPATH": _pythonpath(),
            "ELASTIC_RENDEZVOUS": server_address, "ELASTIC_JOB_ID": job_id, "ELASTIC_HOST": "host0",
            "ELASTIC_MIN_NP": str(min_np), "ELASTIC_MAX_NP": str(max_np), "JOB_OUT": self.out,
            "ELASTIC_WORLD_TIMEOUT": "60", "ELASTIC_COLLECTIVE_TIMEOUT": "20",
            "GRPC_ENABLE_FORK_SUPPORT": "0",   # as elastic-run starts its workers (a job may fork)
        })
        self.env.update({k: str(v) for k, v in env.items()})
        self.procs: Dict[str, Union[subprocess.Popen, ForkedProcess]] = {}

    def start(self, worker_id: str, *, prefix: Sequence[str] = (),
              **env: str) -> Union[subprocess.Popen, ForkedProcess]:
        """Starts a worker, forked from the fork server (unless the job is not ``forked``);
        ``prefix`` runs it as a new process under another command (e.g. ``ip netns exec NS``)."""
        e = dict(self.env, ELASTIC_WORKER_ID=worker_id, **{k: str(v) for k, v in env.items()})
        with open(os.path.join(self.out, f"log-{worker_id}.txt"), "wb") as log:
            if prefix or not self.forked:
                self.procs[worker_id] = subprocess.Popen([*prefix, sys.executable, self.script], env=e, stdout=log,
                                                         stderr=subprocess.STDOUT, cwd=REPO)
            else:
                self.procs[worker_id] = fork_server().spawn([sys.executable, self.script], e, cwd=REPO,
                                                            output=log.fileno())
        return self.procs[worker_id]

    def progress(self, worker_id: str) -> Optional[tuple]:
        try:
            with open(os.path.join(self.out, f"progress-{worker_id}.txt")) as f:
                step, size, version = f.read().split()
            return int(step), int(size), int(version)
        except (FileNotFoundError, ValueError):
            return None

    def wait_step(self, step: int, workers, timeout: float = 60) -> None:
        wait_until(lambda: all((self.progress(w) or (0,))[0] >= step for w in workers), timeout,
                   f"{list(workers)} to reach step {step}")

    def kill(self, worker_id: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.procs[worker_id].pid, sig)

    def wait(self, workers, timeout: float = 120) -> Dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for w in workers:
            try:
                codes[w] = self.procs[w].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"worker {w} still running after {timeout} s:\n{self.log(w)}") from None
        return codes

    def log(self, worker_id: str) -> str:
        with open(os.path.join(self.out, f"log-{worker_id}.txt"), "rb") as f:
            return f.read().decode(errors="replace")[-6000:]

    def result(self, worker_id: str) -> dict:
        path = os.path.join(self.out, f"result-{worker_id}.json")
        assert os.path.exists(path), f"worker {worker_id} wrote no result:\n{self.log(worker_id)}"
        with open(path) as f:
            return json.load(f)

    def events(self, worker_id: str) -> list:
        """The worker's events-<id>.jsonl records (see job.py), in order."""
        path = os.path.join(self.out, f"events-{worker_id}.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                os.kill(p.pid, signal.SIGKILL)   # not reaped yet: the pid is still its
                p.wait(10)
