"""Stragglers end to end: a real launcher, its embedded rendezvous server and real worker
processes, one of them slowed from outside by SIGSTOP/SIGCONT duty cycles shorter than the
heartbeat (a slow worker, never a hung one). One job per policy, several rules checked on each."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Dict, List, Sequence

from rendezvous.client.status_client import StatusClient

from .launch_helpers import REPO, wait_until
import pytest

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane

JOB = os.path.join(REPO, "tests", "launch", "straggler_job.py")
WINDOW = ["--straggler-window", "0.3", "--straggler-windows", "3"]
STEP = re.compile(r"^\[(\S+)\] step (\d+) size (\d+)$")


class DutyCycle:
    """Stops the processes `pids` for `stopped_s`, lets them run for `running_s`, over and over,
    all at once, until closed (then they run). A worker stopped 60% of the time takes 2.5 times
    as long for its steps; 0.06 s stopped is far below the rendezvous heartbeat."""

    def __init__(self, pids: Sequence[int], stopped_s: float = 0.06, running_s: float = 0.04):
        self.pids, self.stopped_s, self.running_s = list(pids), stopped_s, running_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _signal(self, sig: int) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:   # it left: nothing more to slow
                pass

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                self._signal(signal.SIGSTOP)
                self._done.wait(self.stopped_s)
                self._signal(signal.SIGCONT)
                self._done.wait(self.running_s)
        finally:
            self._signal(signal.SIGCONT)

    def __enter__(self) -> "DutyCycle":
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(5)
        self._signal(signal.SIGCONT)


def steps(lines: List[str]) -> Dict[str, List[int]]:
    """worker id -> the steps it printed, in order."""
    out: Dict[str, List[int]] = {}
    for line in list(lines):
        m = STEP.match(line)
        if m:
            out.setdefault(m.group(1), []).append(int(m.group(2)))
    return out


def last_step(p) -> int:
    return max((s[-1] for s in steps(p.stdout).values()), default=0)


def events(path) -> List[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def embedded_server(p):
    address = p.wait_for(r"rendezvous server for job default on (127\.0\.0\.1:\d+) \(embedded\)", 30).group(1)
    token_file = p.wait_for(r"its token is in (\S+) \(readable by this user only\)", 5).group(1)
    return address, token_file


def test_report_names_the_slowed_worker_within_its_windows_and_nobody_slow_once_or_slow_everywhere(launch, tmp_path):
    log, stop = tmp_path / "events.jsonl", tmp_path / "stop"
    p = launch("--np", "4", "--host", "hA", "--straggler-policy", "report", *WINDOW, "--metrics-port", "0",
               "--events", str(log), command=[sys.executable, JOB], LW_STOP=str(stop), LW_ALONE="20:1.0")
    url = p.wait_for(r"metrics of this host's workers on (http://\S+/metrics)", 30).group(1)
    address, token_file = embedded_server(p)
    p.wait_training(4, 60)
    pids = {f"hA-{i}": p.worker_pid(f"hA-{i}") for i in range(4)}
    # Rank 0 works alone once (an evaluation between commits): one slow window, then normal ones.
    p.wait_for(r"^\[hA-\d\] working alone for 1 s$", 30, stream="out")
    mark = last_step(p)
    wait_until(lambda: last_step(p) >= mark + 30, 60, "windows after the evaluation")
    # Everyone slowed alike: the median moves with them.
    with DutyCycle(pids.values()):
        mark = last_step(p)
        wait_until(lambda: last_step(p) >= mark + 30, 60, "windows of a world slow everywhere")
    # One worker slowed: named after three windows.
    with DutyCycle([pids["hA-2"]]):
        started = time.monotonic()
        named = p.wait_for(r"worker hA-2 \(rank (\d)\) on host hA is a straggler: it computed ([0-9.]+)x the median "
                           r"of world \d+ for 3 commit windows in a row \(--straggler-policy report: it stays\)", 60)
        print(f"named {time.monotonic() - started:.2f} s after the slowdown began, at {named.group(2)}x")
        rank = named.group(1)
        # The metric and the status table say the same while it is slow.
        scores = {}

        def scraped():
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            scores.update({m.group(1): float(m.group(2)) for m in re.finditer(
                r'^elastic_straggler_score\{rank="\d",worker="(hA-\d)"\} (\S+)$', text, re.M)})
            return len(scores) == 4 and scores["hA-2"] > 1.5
        wait_until(scraped, 30, "elastic_straggler_score of the four workers, hA-2's above the factor")
        assert all(s < 1.5 for w, s in scores.items() if w != "hA-2"), scores
        shown = subprocess.run([sys.executable, "-m", "rendezvous", "status", "--server", address, "--token-file",
                                token_file, "--watch"], cwd=REPO, capture_output=True, text=True, timeout=30)
        rows = [line for line in shown.stdout.splitlines() if re.match(r"^\d+\s+hA-\d", line)]
        assert len(rows) == 4 and [r.split()[1] for r in rows if "STRAGGLER" in r] == ["hA-2"], shown.stdout
    stop.touch()
    assert p.wait(60) == 0, p.text()
    named_events = [e for e in events(log) if e["event"] == "straggler_detected"]
    assert [(e["worker_id"], e["host"], str(e["rank"]), e["windows"]) for e in named_events] == [
        ("hA-2", "hA", rank, 3)], named_events
    assert named_events[0]["factor"] >= 1.5
    # Nobody was evicted, nobody left, nothing was restored.
    assert not [e for e in events(log) if e["event"] in ("preempted", "recovery")]
    assert not any("left" in line or "restoring commit" in line for line in p.stderr), p.text()
    assert [w for w in pids if any(f"worker {w} (rank" in line and "is a straggler" in line
                                   for line in p.stderr if line.startswith(f"[{w}]"))] == ["hA-2"]


def test_evict_keeps_a_straggler_min_np_needs_and_it_leaves_at_a_commit_once_a_spare_can_take_its_place(launch, tmp_path):
    log, stop = tmp_path / "events.jsonl", tmp_path / "stop"
    job = dict(command=[sys.executable, JOB], LW_STOP=str(stop))
    # min-np 4 and no room beyond: only the spare on host hB lets the straggler go.
    a = launch("--np", "4", "--min-np", "4", "--max-np", "4", "--host", "hA", "--straggler-policy", "evict", *WINDOW,
               "--events", str(log), **job)
    address, token_file = embedded_server(a)
    a.wait_training(4, 60)
    with DutyCycle([a.worker_pid("hA-2")]):
        # Named, but with no spare it stays: the job would drop below --min-np without it.
        a.wait_for(r"^\[hA-2\] .*worker hA-2 stays although it is a straggler: without it world version \d+ would "
                   r"have 3 worker\(s\), below min-np 4, and no spare is waiting to take its place", 60)
        b = launch("--np", "1", "--host", "hB", "--rendezvous", address, "--job-id", "default", "--token-file",
                   token_file, "--straggler-policy", "evict", *WINDOW, **job)
        b.wait_for(r"^\[hB-0\] .*worker hB-0 on standby: beyond max_np", 30)
        a.wait_for(r"^\[hA-2\] .*worker hA-2 left job default gracefully \(a straggler: [0-9.]+x the median compute "
                   r"time for \d+ windows\)", 60)
    # Its host cools down in the rendezvous blacklist (the embedded server's first cooldown: 10 s).
    with StatusClient([address], token=open(token_file).read().strip()) as status:
        view = status.job("default")
        assert view.blacklisted_hosts == ("hA",) and "hA-2" not in {m.worker_id for m in view.members}
    a.wait_for(r"world \d+: 4 worker\(s\); left: hA-2; joined: hB-0$", 30)
    a.wait_for(r"worker hA-2 \(rank \d\) left as a straggler \(--straggler-policy evict\); slot 2 is retired, not "
               r"respawned: host hA is the slow spot", 30)
    b.wait_for(r"^\[hB-0\] step \d+ size 4$", 30, stream="out")
    mark = last_step(a)
    wait_until(lambda: last_step(a) >= mark + 20, 60, "training on with the spare")
    stop.touch()
    assert a.wait(60) == 0, a.text()
    assert b.wait(60) == 0, b.text()
    # It left gracefully at a commit: the others kept their state (no restore, no recovery) ...
    text = "\n".join(a.stderr + b.stderr)
    assert "restoring commit" not in text and "recovered" not in text, text[-3000:]
    # ... and nothing was redone: every survivor counted each step once, and the spare went on
    # from the commit the straggler left at.
    done = steps(a.stdout) | steps(b.stdout)
    for w in ("hA-0", "hA-1", "hA-3"):
        assert done[w] == list(range(1, done[w][-1] + 1)), w
    spare = done["hB-0"]
    assert spare == list(range(spare[0], spare[-1] + 1)) and spare[-1] == done["hA-0"][-1]
    assert done["hA-2"] == list(range(1, spare[0]))
    # The others went on at their own pace: nobody else was named.
    kinds = [(e["event"], e.get("worker_id"), e.get("why")) for e in events(log)
             if e["event"] in ("straggler_detected", "preempted")]
    assert kinds == [("straggler_detected", "hA-2", None), ("preempted", "hA-2", "a straggler")], kinds
    # Its slot was retired: no worker went back into the slow spot.
    assert [e["slot"] for e in events(log) if e["event"] == "worker_started"] == [0, 1, 2, 3]
    assert not [e for e in events(log) if e["event"] == "worker_respawned"]
