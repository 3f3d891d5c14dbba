"""Runs tests/elastic/job.py as real worker processes against a real rendezvous server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, Optional, Sequence
from tests.waiting import wait_until  # noqa: F401  (re-exported for the tests here)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(REPO, "tests", "elastic", "job.py")




class Job:
    def __init__(self, tmp_path, server_address: str, *, job_id: str = "job", min_np: int = 1, max_np: int = 8,
                 script: str = JOB, **env: str):
        self.out = str(tmp_path)
        self.script = script
        self.env = dict(os.environ)
        self.env.update({
            "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "ELASTIC_RENDEZVOUS": server_address, "ELASTIC_JOB_ID": job_id, "ELASTIC_HOST": "host0",
            "ELASTIC_MIN_NP": str(min_np), "ELASTIC_MAX_NP": str(max_np), "JOB_OUT": self.out,
            "ELASTIC_WORLD_TIMEOUT": "60", "ELASTIC_COLLECTIVE_TIMEOUT": "20",
            "GRPC_ENABLE_FORK_SUPPORT": "0",   # as elastic-run starts its workers (a job may fork)
        })
        self.env.update({k: str(v) for k, v in env.items()})
        self.procs: Dict[str, subprocess.Popen] = {}

    def start(self, worker_id: str, *, prefix: Sequence[str] = (), **env: str) -> subprocess.Popen:
        """Starts a worker; ``prefix`` runs it under another command (e.g. ``ip netns exec NS``)."""
        e = dict(self.env, ELASTIC_WORKER_ID=worker_id, **{k: str(v) for k, v in env.items()})
        log = open(os.path.join(self.out, f"log-{worker_id}.txt"), "wb")
        self.procs[worker_id] = subprocess.Popen([*prefix, sys.executable, self.script], env=e, stdout=log, stderr=subprocess.STDOUT,
                                                 cwd=REPO)
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
                p.kill()
                p.wait(10)
