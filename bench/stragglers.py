"""Stragglers: the same DDP job with one worker slowed 2x, under each --straggler-policy, and the cost of detection.

    python bench/stragglers.py                    # 4 workers, 30 s measured per run, 3 repetitions of the cost runs
    python bench/stragglers.py --quick            # 15 s per run, 2 repetitions
    python bench/stragglers.py --duration 60 --repeats 5 --commit-every 5

Every run trains bench/_straggler_worker.py (a ~1.1M-parameter MLP, --batch samples per rank and
step, elastic.DistributedDataParallel, state.commit() every --commit-every steps, one torch
thread per worker: steps that are mostly arithmetic, as in most real jobs) under `elastic-run
--np W --host bench`, with the straggler settings' defaults (--straggler-factor 1.5,
--straggler-windows 3, --straggler-window 1). Measuring starts --warmup seconds after the job's
first step and lasts --duration seconds:

  slowed runs   from the start of the measurement, worker bench-1 computes at half speed:
                --slowdown throttle (the default) makes it idle after each forward pass twice
                as long as the pass took, as a 50% CPU quota would (its compute time doubles
                even where workers share cores); --slowdown sigstop stops it for 50 ms of every
                100 ms (SIGSTOP/SIGCONT from this script: far below the heartbeat, so it is slow,
                never taken for hung; where workers outnumber cores, the others get its core
                while it is stopped, so its compute time grows less than 2x):
                  no policy   --straggler-policy off
                  report      --straggler-policy report: named, it stays
                  evict       --straggler-policy evict --max-np W, and a spare: a second elastic-run
                              --np 1 --host spare joined to the job, on standby beyond max-np. The
                              straggler leaves at a commit, the spare takes its place.
  fault-free    nobody slowed; --repeats runs with --straggler-policy off and as many with report,
                alternating (the load from elsewhere on a shared machine drifts): what detection
                costs when there is no straggler (target: within the noise of off).

Figures, from the workers' step logs (bench/_straggler_worker.py) and the launcher's --events file:

  steps/s, samples/s   progress of the job's step counter over the measured seconds (samples:
                       --batch per rank and step, at the world size each step ran in)
  named after          from the start of the slowdown to the launcher's straggler_detected event,
                       in seconds, and the commit windows it was slow for (its `windows` field)
  replaced after       (evict) to the first step of the spare; steps/s from then to the end

Only elastic-run runs here: no peer. Nothing is asserted: the numbers are printed, noisy on a
machine shared with other work (the load average is printed with them). Every process of a run
is SIGKILLed at its end (bench/_launch.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _launch import Launch, Watched, new_tag  # noqa: E402  (bench/ is this script's directory)
from goodput import EventLogs, first_step, load, step_rate  # noqa: E402

WORKER = os.path.join(REPO, "bench", "_straggler_worker.py")
BIN = os.path.dirname(sys.executable)
SLOWED = "bench-1"            # the worker slowed in the slowed runs
STOPPED_S, RUNNING_S = 0.05, 0.05


class DutyCycle:
    """Stops process ``pid`` for STOPPED_S of every STOPPED_S + RUNNING_S until closed."""

    def __init__(self, pid: int):
        self.pid = pid
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="duty-cycle", daemon=True)
        self._thread.start()

    def _signal(self, sig: int) -> bool:
        try:
            os.kill(self.pid, sig)
            return True
        except ProcessLookupError:   # it left (evicted): nothing more to slow
            return False

    def _run(self) -> None:
        try:
            while not self._done.is_set() and self._signal(signal.SIGSTOP):
                self._done.wait(STOPPED_S)
                self._signal(signal.SIGCONT)
                self._done.wait(RUNNING_S)
        finally:
            self._signal(signal.SIGCONT)

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)
        self._signal(signal.SIGCONT)


# ---------------------------------------------------------------------- figures
class Throttle:
    """Tells worker ``worker_id`` of the run in ``run_dir`` to idle as long as it computes
    (bench/_straggler_worker.py reads the file), until closed."""

    def __init__(self, path: str, worker_id: str):
        self.path = path
        with open(path + ".tmp", "w") as f:
            f.write(worker_id)
        os.replace(path + ".tmp", path)

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def samples_between(events, t0: float, t_end: float, batch: int) -> int:
    """Samples of the steps the job's counter advanced over (t0, t_end], each at its world's size."""
    size_of: Dict[int, int] = {}
    for e in events:
        if e.ev == "step" and e.t <= t_end:
            size_of.setdefault(e.step, e.size)
    start = max((e.step for e in events if e.ev == "step" and e.t <= t0), default=0)
    end = max(size_of, default=0)
    return sum(size_of.get(s, 0) * batch for s in range(start + 1, end + 1))


def launcher_events(path: str) -> List[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


@dataclass
class Result:
    label: str
    rate: float = math.nan
    samples: float = math.nan
    named_s: Optional[float] = None
    windows: Optional[int] = None
    factor: Optional[float] = None
    replaced_s: Optional[float] = None
    rate_after: float = math.nan
    left: List[str] = field(default_factory=list)
    error: str = ""


class Run(Watched):
    def __init__(self, args, out: str, label: str, policy: str, slow: bool, spare: bool):
        self.args, self.label, self.policy, self.slow, self.spare = args, label, policy, slow, spare
        self.name = label
        self.dir = os.path.join(out, label)
        os.makedirs(self.dir)
        self.logs = EventLogs(self.dir)
        self.events_path = os.path.join(self.dir, "launcher-events.jsonl")
        self.spare_events = os.path.join(self.dir, "spare-events.jsonl")
        self.tag = new_tag("bench-stragglers")
        deadline = time.time() + args.start_timeout + args.warmup + args.duration + 60
        self.slow_file = os.path.join(self.dir, "slow")
        self.env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_DEADLINE=f"{deadline:.3f}", BENCH_SLOW_FILE=self.slow_file,
                        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        worker = ["--", sys.executable, WORKER, "--run-dir", self.dir, "--commit-every", str(args.commit_every),
                  "--batch", str(args.batch)]
        cmd = [os.path.join(BIN, "elastic-run"), "--np", str(args.workers), "--host", "bench",
               "--straggler-policy", policy, "--events", self.events_path]
        if spare:
            cmd += ["--max-np", str(args.workers)]
        self.launches = [Launch(cmd + worker, self.env, self.tag, os.path.join(self.dir, "launcher.log"), cwd=REPO)]
        self.worker = worker

    def check(self) -> None:
        for launch in self.launches:
            launch.check_running(f"{self.label}: elastic-run")

    def start_spare(self) -> None:
        """A second elastic-run on host "spare", joined to the job: it waits on standby."""
        main = self.launches[0]
        address = self.wait_for(lambda: re.search(r"rendezvous server for job default on (\S+) \(embedded\)",
                                                  main.output()), 60, "embedded server").group(1)
        token_file = self.wait_for(lambda: re.search(r"its token is in (\S+) \(readable", main.output()), 60,
                                   "token file").group(1)
        self.launches.append(Launch([os.path.join(BIN, "elastic-run"), "--np", "1", "--host", "spare", "--rendezvous",
                                     address, "--job-id", "default", "--token-file", token_file,
                                     "--straggler-policy", self.policy, "--events", self.spare_events] + self.worker,
                                    self.env, self.tag, os.path.join(self.dir, "spare.log"), cwd=REPO))
        self.wait_for(lambda: "on standby: beyond max_np" in self.launches[1].output(), self.args.start_timeout,
                      "spare on standby")

    def pid_of(self, worker_id: str) -> int:
        for e in launcher_events(self.events_path):
            if e.get("event") == "worker_started" and e.get("worker_id") == worker_id:
                return int(e["pid"])
        raise RuntimeError(f"{self.label}: no worker_started event for {worker_id}")

    def run(self) -> Result:
        result = Result(self.label)
        first = self.wait_for(lambda: first_step(self.logs.events), self.args.start_timeout, "first step")
        if self.spare:
            self.start_spare()
        t0 = max(first + self.args.warmup, time.time())
        self.sleep_until(t0)
        slowed = None
        if self.slow:
            slowed = (Throttle(self.slow_file, SLOWED) if self.args.slowdown == "throttle"
                      else DutyCycle(self.pid_of(SLOWED)))
        t0 = time.time()
        t_end = t0 + self.args.duration
        try:
            self.sleep_until(t_end)
        except RuntimeError as e:
            result.error = str(e)
            t_end = time.time()
        finally:
            if slowed is not None:
                slowed.close()
        self.logs.poll()
        events = self.logs.events
        result.rate = step_rate(events, t0, t_end)
        result.samples = samples_between(events, t0, t_end, self.args.batch) / (t_end - t0)
        for e in launcher_events(self.events_path):
            if e.get("event") == "straggler_detected" and result.named_s is None and e["time"] >= t0:
                result.named_s, result.windows, result.factor = e["time"] - t0, e.get("windows"), e.get("factor")
            if e.get("event") == "preempted":
                result.left.append(e.get("worker_id", "?"))
        if self.spare:
            spare_pids = {int(x["pid"]) for x in launcher_events(self.spare_events) if x.get("event") == "worker_started"}
            steps = [e.t for e in events if e.ev == "step" and e.pid in spare_pids and e.t >= t0]
            if steps:
                result.replaced_s = min(steps) - t0
                result.rate_after = step_rate(events, min(steps), t_end)
        return result

    def close(self) -> None:
        for launch in reversed(self.launches):
            launch.close(grace=0)


def one(args, out: str, label: str, policy: str, slow: bool, spare: bool = False) -> Result:
    print(f"# {label}: --straggler-policy {policy}" + (f", {SLOWED} slowed 2x" if slow else ", nobody slowed")
          + (", a spare on standby" if spare else "") + f"; load average {load()} ...", flush=True)
    run = Run(args, out, label, policy, slow, spare)
    try:
        r = run.run()
    except (TimeoutError, RuntimeError) as e:
        r = Result(label, error=str(e))
    finally:
        run.close()
    named = f", named after {r.named_s:.2f} s ({r.windows} windows, {r.factor}x)" if r.named_s is not None else ""
    print(f"  {r.rate:.2f} steps/s, {r.samples:.0f} samples/s{named}"
          + (f", left: {', '.join(r.left)}" if r.left else "")
          + (f", spare stepping after {r.replaced_s:.2f} s, then {r.rate_after:.2f} steps/s"
             if r.replaced_s is not None else "") + (f"; ERROR {r.error}" if r.error else ""), flush=True)
    return r


# ---------------------------------------------------------------------- tables
def cell(x: Optional[float], fmt: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def mean_sd(xs: List[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.2f} ± {sd:.2f} ({', '.join(f'{x:.2f}' for x in xs)})"


def tables(args, slowed: Dict[str, Result], off: List[Result], report: List[Result]) -> List[str]:
    free = statistics.mean([r.rate for r in off + report if not math.isnan(r.rate)] or [math.nan])
    free_samples = statistics.mean([r.samples for r in off + report if not math.isnan(r.samples)] or [math.nan])
    cols = [("no policy (off)", slowed["off"]), ("report", slowed["report"]), ("evict, with a spare", slowed["evict"])]
    lines = [f"| {args.workers} workers, {SLOWED} slowed 2x ({args.slowdown}), {args.duration:g} s measured | "
             + " | ".join(c for c, _ in cols) + " | fault-free |", "| --- |" + " --- |" * (len(cols) + 1)]

    def row(name: str, fn, fault_free: str = "") -> None:
        lines.append(f"| {name} | " + " | ".join(fn(r) for _, r in cols) + f" | {fault_free} |")

    row("steps/s", lambda r: cell(r.rate), cell(free))
    row("samples/s", lambda r: cell(r.samples, ".0f"), cell(free_samples, ".0f"))
    row("steps/s / fault-free", lambda r: cell(r.rate / free if free else math.nan), "1.00")
    row("named after, s (windows)", lambda r: f"{cell(r.named_s)} ({r.windows})" if r.named_s is not None else "-")
    row("left the job", lambda r: ", ".join(r.left) or "-")
    row("spare stepping after, s", lambda r: cell(r.replaced_s))
    row("steps/s from then on", lambda r: cell(r.rate_after))
    off_rates, report_rates = [r.rate for r in off], [r.rate for r in report]
    lines += ["", f"| fault-free, {args.repeats} runs each, {args.duration:g} s measured | steps/s: mean ± sd "
              "(each run) |", "| --- | --- |",
              f"| --straggler-policy off | {mean_sd(off_rates)} |",
              f"| --straggler-policy report | {mean_sd(report_rates)} |"]
    valid_off = [x for x in off_rates if not math.isnan(x)]
    valid_report = [x for x in report_rates if not math.isnan(x)]
    if len(valid_off) > 1 and len(valid_report) > 1:
        diff = statistics.mean(valid_report) - statistics.mean(valid_off)
        noise = math.sqrt(statistics.variance(valid_off) / len(valid_off)
                          + statistics.variance(valid_report) / len(valid_report))
        lines.append(f"| report - off | {diff:+.2f} steps/s ({diff / statistics.mean(valid_off) * 100:+.1f}%); "
                     f"standard error of the difference {noise:.2f} |")
    return lines


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4, help="workers in the job (default 4)")
    ap.add_argument("--duration", type=float, default=None, help="seconds measured per run (default 30; --quick 15)")
    ap.add_argument("--warmup", type=float, default=10.0,
                    help="seconds from the first step to the start of the measurement (default 10)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="fault-free runs with each of off and report (default 3; --quick 2)")
    ap.add_argument("--commit-every", type=int, default=10, help="steps between commits (default 10)")
    ap.add_argument("--batch", type=int, default=256, help="samples per rank and step (default 256)")
    ap.add_argument("--slowdown", choices=("throttle", "sigstop"), default="throttle",
                    help="how bench-1 is slowed 2x: throttle (idles as long as it computes, as under a 50%% CPU "
                         "quota; the default) or sigstop (stopped 50 ms of every 100 ms)")
    ap.add_argument("--quick", action="store_true", help="--duration 15 --repeats 2")
    ap.add_argument("--start-timeout", type=float, default=180, help="seconds a job may take to its first step")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (step logs, launcher logs)")
    args = ap.parse_args(argv)
    if args.duration is None:
        args.duration = 15.0 if args.quick else 30.0
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    if args.workers < 3:
        ap.error("--workers must be at least 3 (the evict run keeps the others' median)")
    if not (args.duration > 0 and args.warmup >= 0 and args.repeats >= 1 and args.commit_every >= 1
            and args.batch >= 1):
        ap.error("--duration must be positive, --warmup not negative, --repeats, --commit-every and --batch at "
                 "least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    out = tempfile.mkdtemp(prefix="bench-stragglers-")
    print(f"# stragglers: {args.workers} workers, {os.cpu_count()} CPUs, load average {load()}; commit every "
          f"{args.commit_every} steps; slowdown {args.slowdown}; run directory {out}", flush=True)
    try:
        off: List[Result] = []
        report: List[Result] = []
        for i in range(args.repeats):
            off.append(one(args, out, f"fault-free-off-{i}", "off", slow=False))
            report.append(one(args, out, f"fault-free-report-{i}", "report", slow=False))
        slowed = {"off": one(args, out, "slowed-off", "off", slow=True),
                  "report": one(args, out, "slowed-report", "report", slow=True),
                  "evict": one(args, out, "slowed-evict", "evict", slow=True, spare=True)}
    except KeyboardInterrupt:
        print("# interrupted: every process of the run was stopped", flush=True)
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    print(f"# load average {load()} at end")
    print()
    for line in tables(args, slowed, off, report):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
