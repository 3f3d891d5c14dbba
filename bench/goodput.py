"""Goodput under faults: the same DDP job under torchrun, elastic-run and TorchFT, one worker SIGKILLed every F s.

    python bench/goodput.py                       # 4 workers, a SIGKILL every 20 s and every 60 s, 300 s each
    python bench/goodput.py --quick --plot g.png  # every 10 s and 20 s for 30 s (7-10 minutes)
    python bench/goodput.py --every 30 --duration 300 --commit-every 20 --seed 3
    python bench/goodput.py --fsdp                # the model sharded with FSDP2 (see below)
    python bench/goodput.py --preload torch       # elastic-run forks its workers from a process holding torch
    python bench/goodput.py --launchers elastic-run --repeat 3   # three cycles: goodput's spread on this machine

Every run trains bench/_goodput_worker.py's model (~9M-parameter MLP, 32 samples per rank and
step, SGD with momentum, DDP's default buckets, one torch thread per worker) on --workers workers
(TorchFT needs `pip install -e '.[bench]'`). Each system runs in the configuration its own
documentation gives a fault-tolerant job; bench/_goodput_systems.py holds every command line and
setting with its source, and the output begins with them, so any row can be rerun by hand:

  torchrun          torchrun --standalone (c10d rendezvous) --nproc-per-node W --max-restarts R;
                    torch DDP over gloo; rank 0 checkpoints model, optimizer and step to disk
                    every --commit-every steps, and every (re)start loads the checkpoint, as
                    torchrun's documentation advises (elastic/train_script). A failure restarts
                    every worker (torchrun's design). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the
                    opt-out pytorch/pytorch#135712 gives, without which no restart succeeds here.
  elastic-run       elastic-run --np W --min-np 2 --max-restarts R; elastic.DistributedDataParallel
                    in @elastic.run with state.commit() every --commit-every steps. The survivors
                    keep their state and go on without the killed worker; elastic-run respawns
                    it, and it joins at a commit.
  torchft           TorchFT (bench/_torchft_launch.py, bench/_torchft_worker.py): its lighthouse
                    (--quorum_tick_ms 100 --join_timeout_ms 10000, as TorchFT's README starts
                    it), one replica group per worker (one process each) with torchft.Manager,
                    torchft.ProcessGroupGloo and torchft.DistributedDataParallel, with the
                    settings of TorchFT's DDP example, train_ddp.py: ProcessGroupGloo(timeout=5 s),
                    Manager(timeout=30 s), the state sent by PGTransport(timeout=10 s)
                    (bench/_torchft_settings.py cites file and line). The launch script restarts
                    a killed group, as TorchFT expects of a scheduler, and it heals from a live
                    peer. A step a peer's failure broke is not committed: its batches are
                    dropped, nothing is redone.
  torchft-defaults  the same with none of those set: the library's 60 s timeouts and the state
                    over HTTP (what this bench ran as "TorchFT" before; its recovery from a
                    SIGKILL takes about twice the example's).

With --fsdp torchrun and elastic-run shard the model with FSDP2 (each Linear, then the root)
and train it with AdamW, on the same sample stream and with the same figures: torchrun over
gloo saves a torch.distributed.checkpoint (every rank its shards, the step and the stream
position) every --commit-every steps and reloads it on every restart (dcp.save and dcp.load of
get_state_dict/set_state_dict, as torch's distributed checkpoint recipe does; its dcp.async_save,
which overlaps the save with training, is not measured here); elastic-run's workers
hold it in elastic.ShardedState, which commits the shards in memory and on a buddy and
reshards them onto the survivors after a failure. TorchFT is not part of --fsdp (its sharded
mode, FT-HSDP, shards inside a replica group; not measured here).

For each, a fault-free run of --fault-free-seconds before the fault runs and another after
them (the load from elsewhere on a shared machine drifts; their mean is the fault-free rate),
and the fault run: from the job's first step, every --every seconds for --duration seconds
one worker process chosen at random (--seed) among those training is sent SIGKILL (when the
previous fault has not recovered by then, the next one waits for it); one fault run per
--every value. Every worker appends a line per step and per commit to a file, each step with
the sample indices it trained (bench/_goodput_worker.py); all figures come from those lines:

  fault-free steps/s   steps completed in a fault-free run / its length (checkpoint or
                       commit cost included); the mean of the run before and the one after.
  useful steps/s       steps that count toward the final model: the last step committed (or
                       checkpointed) by the end of the fault run / --duration. The ratio to
                       fault-free is the goodput.
  useful samples/s     distinct samples trained in the steps the final model holds (each
                       step's newest run: a step undone by a restore and trained again counts
                       once; a batch TorchFT dropped counts nothing) / --duration: a world of
                       3 after a fault does 3/4 of the samples per step (and, on a machine with
                       fewer cores than workers, can step faster).
  samples dropped      samples the job's data stream moved past that no held step trained (a
                       dropped batch, a skipped shard): the streams are torchrun's and
                       elastic-run's one global position (in the checkpoint / committed state)
                       and TorchFT's one shard per replica group (torchft.DistributedSampler's).
  recovery per fault   from the SIGKILL to the first step completed in the next world (a new
                       world version, or torchrun's next restart) by a process other than the
                       victim; "of which to training resumed" is the part before that world's
                       training loop started (its state loaded or synced: a "resume" event),
                       the rest being its first step (TorchFT logs none: its quorum is part of
                       its step).
  steps redone         the highest step completed before the fault minus the step the next
                       world restarted from (what was trained since the last commit or
                       checkpoint); the step in flight at the SIGKILL is not counted.
  steps/s by world     in the fault run, the rate while the world had all --workers and while
                       it had fewer (between two steps of one world; the pauses of re-forms,
                       restarts and joins are left out): shows how much of the useful rate
                       comes from a smaller world's faster steps.
  own rate             useful samples/s over the samples/s the fault run itself trained while
                       it had all --workers: what faults cost the job measured inside one run,
                       so load that differs between the fault-free runs and the fault run (a
                       machine shared with other work) does not move it as it moves goodput.

With --repeat K the fault runs are made K times (cycles), with a fault-free run before,
between and after them, and each fault run is measured against the fault-free runs either
side of it. Every cycle's goodput is then printed side by side with their mean and range (one
run's goodput moves with this machine's speed by several percent, so a figure near 1 needs
its spread next to it), and so is each fault run's useful steps/s over its own rate while it
had all --workers: a ratio the drift between runs does not move, though it misses any slowdown
that faults cause a whole world.

The torchrun runs set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 unless it is set: without it,
torchrun's restarts fail here (see TORCH_STORE_ENV in bench/_goodput_systems.py).

The launchers start in sessions of their own; at the end, on an error and on Ctrl-C every
process of a run is SIGKILLed (found by a tag in its environment), and workers end themselves
at a deadline in any case. Nothing is asserted: the numbers are printed, noisy on a machine
shared with other work (the load average is printed with them). elastic-run's targets are
printed next to its figures, met or MISSED: goodput >= 0.97 at one SIGKILL a minute and >= 0.95
at one per 20 s, 0 steps redone, 0 samples dropped. Recovery is printed without one: its target
(<= 0.1 s from the SIGKILL to the next step completed on every survivor) is for the chaos soak's
small job (bench/chaos_soak.py), where it was set; one step of this job takes 0.1-0.2 s by
itself, so its recovery cannot be that short. --plot FILE.png
draws useful steps over time per system and fault rate, faults marked (bench/_goodput_plot.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _launch import TAG_ENV, Launch, Watched, new_tag  # noqa: E402  (bench/ is this script's directory)
from _goodput_systems import FSDP_TITLES, LAUNCHERS, TITLES, TORCHFT, command, configuration, environment  # noqa: E402

BATCH = 32                              # samples per rank and step (bench/_ddp_worker.py)
MAX_LINE = 4096                         # an event line longer than this is not one of ours
MAX_BATCH_SAMPLES = 1 << 16             # a "samples" range longer than this is not one of ours


# ---------------------------------------------------------------------- events
@dataclass(frozen=True)
class Event:
    ev: str      # "step", "commit", "drop" (TorchFT: a batch trained in a step that did not count) or
                 # "resume" (a world's training loop starts; not logged by TorchFT, whose quorum is in its step)
    step: int
    t: float
    gen: int     # world version (elastic), restart count (torchrun) or quorum id (TorchFT)
    size: int
    pid: int
    samples: Optional[Tuple[int, int, int]] = None   # the indices range(start, stop, stride) it trained


def parse_samples(value) -> Optional[Tuple[int, int, int]]:
    """An event's "samples" [start, stop, stride], or None when it is not a well-formed, bounded range."""
    if not (isinstance(value, list) and len(value) == 3 and all(type(v) is int for v in value)):
        return None
    start, stop, stride = value
    if start < 0 or stride < 1 or stop <= start or (stop - start) // stride > MAX_BATCH_SAMPLES:
        return None
    return start, stop, stride


def parse_event(line: str) -> Optional[Event]:
    """One line of a worker's event log, or None when it is not a well-formed event."""
    if len(line) > MAX_LINE:
        return None
    try:
        d = json.loads(line)
    except ValueError:
        return None
    if not isinstance(d, dict) or d.get("ev") not in ("step", "commit", "drop", "resume"):
        return None
    try:
        e = Event(d["ev"], d["step"], d["t"], d["gen"], d["size"], d["pid"])
    except KeyError:
        return None
    if "samples" in d:
        samples = parse_samples(d["samples"])
        if samples is None:
            return None
        e = Event(e.ev, e.step, e.t, e.gen, e.size, e.pid, samples)
    ints = (e.step, e.gen, e.size, e.pid)
    if not all(type(v) is int for v in ints) or type(e.t) not in (int, float) or not math.isfinite(e.t):
        return None
    if e.step < 1 or e.gen < 0 or e.size < 1 or e.pid < 1:
        return None
    return e


class EventLogs:
    """Every worker's event log in a run directory, read incrementally (whole lines only)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self._offsets: Dict[str, int] = {}
        self._partial: Dict[str, bytes] = {}
        self.events: List[Event] = []
        self.bad_lines = 0

    def poll(self) -> List[Event]:
        for name in sorted(os.listdir(self.run_dir)):
            if not (name.startswith("events-") and name.endswith(".jsonl")):
                continue
            path = os.path.join(self.run_dir, name)
            with open(path, "rb") as f:
                f.seek(self._offsets.get(name, 0))
                data = self._partial.get(name, b"") + f.read(16 << 20)
                self._offsets[name] = f.tell()
            *lines, rest = data.split(b"\n")
            self._partial[name] = rest[:MAX_LINE + 1]
            for raw in lines:
                e = parse_event(raw.decode(errors="replace"))
                if e is None:
                    self.bad_lines += 1
                else:
                    self.events.append(e)
        return self.events


# ---------------------------------------------------------------------- figures (pure)
@dataclass
class Fault:
    t: float        # when the SIGKILL was sent (time.time())
    pid: int        # the victim
    gen: int        # the newest world / restart any worker had stepped in at that time


def first_step(events: List[Event]) -> Optional[float]:
    times = [e.t for e in events if e.ev == "step"]
    return min(times) if times else None


def step_rate(events: List[Event], t0: float, t_end: float) -> float:
    """Steps per second over (t0, t_end]: progress of the step counter (no faults in the run)."""
    steps = [e.step for e in events if e.ev == "step" and e.t <= t_end]
    at_start = [e.step for e in events if e.ev == "step" and e.t <= t0]
    if not steps or t_end <= t0:
        return float("nan")
    return (max(steps) - max(at_start, default=0)) / (t_end - t0)


def final_commit(events: List[Event], t_end: float) -> int:
    """The last step committed (or checkpointed) by ``t_end``: what the final model holds."""
    return max((e.step for e in events if e.ev == "commit" and e.t <= t_end), default=0)


def held_runs(events: List[Event], final: int, t_end: float) -> List[Event]:
    """Every rank's step event of the runs the final model holds: for each step 1..final, its
    newest run by ``t_end`` (a restore re-runs a step in a newer world; the old run was undone)."""
    newest: Dict[int, int] = {}
    for e in events:
        if e.ev == "step" and e.step <= final and e.t <= t_end:
            newest[e.step] = max(newest.get(e.step, -1), e.gen)
    return [e for e in events if e.ev == "step" and e.t <= t_end and newest.get(e.step) == e.gen]


@dataclass
class SampleCount:
    useful: int = 0      # distinct samples the final model was trained on
    dropped: int = 0     # samples its data streams moved past without a held step training them
    repeated: int = 0    # samples the held steps trained more than once
    dropped_batches: int = 0   # TorchFT: batches trained in steps that did not count


def count_samples(events: List[Event], final: int, t_end: float) -> SampleCount:
    """Per-sample accounting of the final model. A data stream is a residue class of the
    sample indices (``start % stride``): one stream for torchrun and elastic-run, one per
    replica group for TorchFT. A sample is dropped when its stream has a held sample after
    it while it is held in no step (trained in a step that was thrown away, or skipped)."""
    count = SampleCount(dropped_batches=sum(1 for e in events if e.ev == "drop" and e.t <= t_end))
    # A held step's samples: the union of what its ranks logged (torchrun's and elastic-run's
    # ranks each log the whole world's batch, which any rank that completed the step holds;
    # TorchFT's replica groups log their own). Repeats count across steps only.
    per_step: Dict[Tuple[int, int], set] = {}
    for e in held_runs(events, final, t_end):
        if e.samples is not None:
            per_step.setdefault((e.step, e.gen), set()).add(e.samples)
    streams: Dict[Tuple[int, int], set] = {}
    for ranges in per_step.values():
        trained = {(stride, i) for start, stop, stride in ranges for i in range(start, stop, stride)}
        for stride, i in sorted(trained):
            seen = streams.setdefault((stride, i % stride), set())
            if i in seen:
                count.repeated += 1
            seen.add(i)
    for (stride, residue), seen in streams.items():
        count.useful += len(seen)
        count.dropped += (max(seen) - residue) // stride + 1 - len(seen)
    return count


def useful_timeline(events: List[Event], final: int, t_end: float) -> List[float]:
    """When each held step completed (its first rank's event), in order: useful steps over time."""
    first: Dict[int, float] = {}
    for e in held_runs(events, final, t_end):
        first[e.step] = min(first.get(e.step, e.t), e.t)
    return sorted(first.values())


def recovered_at(events: List[Event], fault: Fault) -> Optional[Event]:
    """The first step another process completed in a world newer than the fault's."""
    after = [e for e in events if e.ev == "step" and e.pid != fault.pid and e.gen > fault.gen and e.t > fault.t]
    return min(after, key=lambda e: e.t) if after else None


def resumed_at(events: List[Event], fault: Fault, recovery: Event) -> Optional[Event]:
    """Where the world that recovered from the fault started training again: the last "resume"
    another process logged in that world before its first step (None: this system logs none)."""
    before = [e for e in events if e.ev == "resume" and e.pid != fault.pid and e.gen == recovery.gen
              and fault.t < e.t <= recovery.t]
    return max(before, key=lambda e: e.t) if before else None


def steps_redone(events: List[Event], fault: Fault, recovery: Event) -> int:
    """Highest step reached in the fault's world (or before) minus the step the next world restarted from."""
    reached = max((e.step for e in events if e.ev == "step" and e.gen <= fault.gen and e.t <= recovery.t),
                  default=0)
    return max(0, reached - (recovery.step - 1))


def rate_by_size(events: List[Event]) -> Dict[int, float]:
    """Steps/s of the job by world size: over the gaps between consecutive steps of one world
    (each step counted once, when its first worker logged it), so pauses between worlds drop out."""
    first: Dict[Tuple[int, int], Event] = {}
    for e in events:
        if e.ev == "step" and ((e.gen, e.step) not in first or e.t < first[(e.gen, e.step)].t):
            first[(e.gen, e.step)] = e
    gaps: Dict[int, List[float]] = {}
    for (gen, step), e in first.items():
        prev = first.get((gen, step - 1))
        if prev is not None and e.t > prev.t:
            gaps.setdefault(e.size, []).append(e.t - prev.t)
    return {size: len(g) / sum(g) for size, g in gaps.items() if sum(g) > 0}


def newest_gen(events: List[Event]) -> int:
    return max((e.gen for e in events if e.ev == "step"), default=0)


@dataclass
class RunResult:
    launcher: str
    seconds: float
    rate: float = float("nan")          # fault-free runs: steps/s
    final: int = 0                      # fault runs: last committed step
    samples: int = 0                    # distinct samples the final model holds
    every: float = 0.0                  # fault runs: seconds between SIGKILLs
    t0: float = 0.0                     # the run's first step (time.time())
    sample_count: SampleCount = field(default_factory=SampleCount)
    timeline: List[float] = field(default_factory=list)   # held steps' completion times
    faults: List[Fault] = field(default_factory=list)
    recoveries: List[float] = field(default_factory=list)
    resumes: List[float] = field(default_factory=list)    # from the SIGKILL to training resumed
    redone: List[int] = field(default_factory=list)
    by_size: Dict[int, float] = field(default_factory=dict)
    processes: int = 0
    error: str = ""

    @property
    def useful_rate(self) -> float:
        """Fault runs: useful steps/s, the last committed step over the run's length."""
        return self.final / self.seconds


def summarize(result: RunResult, events: List[Event], t0: float, t_end: float, with_faults: bool) -> RunResult:
    result.processes = len({e.pid for e in events})
    if not with_faults:
        result.rate = step_rate(events, t0, t_end)
        return result
    result.final = final_commit(events, t_end)
    result.by_size = rate_by_size([e for e in events if e.t <= t_end])
    result.sample_count = count_samples(events, result.final, t_end)
    result.samples = result.sample_count.useful
    result.timeline = useful_timeline(events, result.final, t_end)
    for f in result.faults:
        rec = recovered_at(events, f)
        if rec is None:
            continue
        result.recoveries.append(rec.t - f.t)
        resumed = resumed_at(events, f, rec)
        if resumed is not None:
            result.resumes.append(resumed.t - f.t)
        result.redone.append(steps_redone(events, f, rec))
    return result


# ---------------------------------------------------------------------- runs
def alive_worker(pid: int, tag: str) -> bool:
    """``pid`` still runs and is one of this run's processes (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read(1 << 20).split(b"\0")
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return f"{TAG_ENV}={tag}".encode() in env and state not in (b"Z", b"X")


class Run(Watched):
    """One launch of the job, with or without faults; ``close()`` leaves no process behind."""

    def __init__(self, launcher: str, args, out: str, with_faults: bool, label: str, every: float = 0.0):
        self.launcher, self.args, self.with_faults = launcher, args, with_faults
        self.name = launcher
        self.every = every
        self.seconds = args.duration if with_faults else args.fault_free_seconds
        self.run_dir = os.path.join(out, f"{launcher}-{label}")
        os.makedirs(self.run_dir)
        self.logs = EventLogs(self.run_dir)
        self.rng = random.Random(args.seed)
        self.tag = new_tag("bench-goodput")
        restarts = self.planned_faults() + 3
        # Workers end themselves at this deadline even if everything else here failed.
        deadline = time.time() + args.start_timeout + self.seconds + args.recovery_timeout + 30
        env = dict(os.environ, **environment(launcher), BENCH_DEADLINE=f"{deadline:.3f}",
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.launch = Launch(command(launcher, args, self.run_dir, restarts), env, self.tag,
                             os.path.join(out, f"{launcher}-{label}.log"), cwd=REPO)

    def planned_faults(self) -> int:
        if not self.with_faults:
            return 0
        return max(0, math.ceil(self.args.duration / self.every) - 1)

    def check(self) -> None:
        self.launch.check_running(self.launcher)

    def victims(self) -> List[int]:
        """Worker processes that run and have stepped in the newest world."""
        gen = newest_gen(self.logs.events)
        stepping = {e.pid for e in self.logs.events if e.ev == "step" and e.gen == gen}
        return sorted(p for p in stepping if alive_worker(p, self.tag))

    def inject(self, n: int, result: RunResult) -> None:
        """One SIGKILL, and the wait for its recovery (so one fault at a time)."""
        pids = self.wait_for(self.victims, self.args.recovery_timeout, "worker stepping to kill")
        victim = self.rng.choice(pids)
        fault = Fault(time.time(), victim, newest_gen(self.logs.events))
        os.kill(victim, signal.SIGKILL)
        result.faults.append(fault)
        rec = self.wait_for(lambda: recovered_at(self.logs.events, fault), self.args.recovery_timeout,
                            f"recovery from fault {n}")
        print(f"  {self.launcher}: fault {n} at +{fault.t - self.t0:5.1f} s: SIGKILL pid {victim} -> "
              f"stepping again in {rec.t - fault.t:6.2f} s, from step {rec.step} "
              f"({steps_redone(self.logs.events, fault, rec)} redone)", flush=True)

    def run(self) -> RunResult:
        result = RunResult(self.launcher, self.seconds, every=self.every)
        self.t0 = result.t0 = self.wait_for(lambda: first_step(self.logs.events), self.args.start_timeout, "first step")
        t_end = self.t0 + self.seconds
        try:
            for n in range(1, self.planned_faults() + 1):
                self.sleep_until(max(self.t0 + n * self.every, time.time()))
                if time.time() >= t_end:
                    break
                self.inject(n, result)
            self.sleep_until(t_end)
        except (TimeoutError, RuntimeError) as e:
            result.error = str(e)
            print(f"  {self.launcher}: {e}", flush=True)
            t_end = min(t_end, time.time())
        # Let the last lines before t_end reach the files, then read them all.
        self.logs.poll()
        return summarize(result, self.logs.events, self.t0, t_end, self.with_faults)

    def close(self) -> None:
        self.launch.close(grace=0)


def one(launcher: str, args, out: str, label: str, every: float = 0.0) -> RunResult:
    with_faults = label.startswith("faults")
    kind = (f"a SIGKILL every {every:g} s for {args.duration:g} s" if with_faults
            else f"fault-free ({label.split('-')[-1]}) for {args.fault_free_seconds:g} s")
    print(f"# {launcher}, {kind}, load average {load()} ...", flush=True)
    run = Run(launcher, args, out, with_faults, label, every)
    try:
        result = run.run()
        if not with_faults:
            print(f"  {launcher}: {result.rate:.2f} steps/s", flush=True)
        return result
    finally:
        run.close()
        if run.logs.bad_lines:
            print(f"  {launcher}: {run.logs.bad_lines} malformed event line(s) ignored", flush=True)


# ---------------------------------------------------------------------- table
def goodput_target(every: float) -> Optional[float]:
    """elastic-run's goodput target at one SIGKILL per ``every`` s (none more often than every 20 s)."""
    if every >= 60:
        return 0.97
    if every >= 20:
        return 0.95
    return None


def met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def percentile(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def table(args, before: Dict[str, RunResult], after: Dict[str, RunResult],
          faulty: Dict[Tuple[str, float], RunResult]) -> List[str]:
    """One row per figure, one column per system, and elastic-run's target (met or not) last."""
    rows: List[Tuple[str, List[str], str]] = []
    rate = {k: (before[k].rate + after[k].rate) / 2 for k in args.launchers}
    elastic = "elastic-run" in args.launchers

    def row(name, fn, target=None):
        """``target``: a function of elastic-run's result giving the target's cell."""
        rows.append((name, [fn(launcher) for launcher in args.launchers],
                     target() if target is not None and elastic else "-"))

    row("fault-free steps/s (run before / after)",
        lambda k: f"{rate[k]:.2f} ({before[k].rate:.2f} / {after[k].rate:.2f})")
    row("fault-free samples/s", lambda k: f"{rate[k] * args.workers * BATCH:.0f}")
    for every in args.every:
        res = {k: faulty[(k, every)] for k in args.launchers}

        def useful(k):
            return res[k].useful_rate

        def goodput(k):
            return useful(k) / rate[k]

        def samples_ratio(k):
            ff = rate[k] * args.workers * BATCH
            got = res[k].samples / res[k].seconds
            return f"{got:.0f} ({got / ff:.2f})"

        def samples_in_run(k):
            whole = res[k].by_size.get(args.workers)
            return f"{res[k].samples / res[k].seconds / (whole * args.workers * BATCH):.2f}" if whole else "-"

        def by_size(k):
            r = res[k].by_size
            full = f"{r[args.workers]:.2f}" if args.workers in r else "-"
            fewer = [f"{r[n]:.2f} ({n})" for n in sorted(r, reverse=True) if n < args.workers]
            return f"{full} / " + (", ".join(fewer) if fewer else "-")

        def recovery(k, what="recoveries"):
            xs = getattr(res[k], what)
            if not xs:
                return "-"
            return f"{percentile(xs, 0.5):.2f} / {percentile(xs, 0.95):.2f}"

        def redone(k):
            xs = res[k].redone
            return f"{sum(xs)} ({statistics.median(xs):.0f}, {max(xs)})" if xs else "-"

        def dropped(k):
            c = res[k].sample_count
            return f"{c.dropped}" + (f" ({c.dropped_batches} batches)" if c.dropped_batches else "")

        target = goodput_target(every)
        e = "elastic-run"
        head = f"SIGKILL every {every:g} s for {args.duration:g} s"
        row(f"**{head}**: useful steps/s", lambda k: f"{useful(k):.2f}")
        row("goodput (useful / fault-free steps/s)", lambda k: f"{goodput(k):.2f}",
            lambda: f">= {target:g} ({met(goodput(e) >= target)})" if target else "-")
        row("useful samples/s (/ fault-free)", samples_ratio)
        row(f"useful samples/s / the fault run's own rate at {args.workers} workers", samples_in_run)
        row(f"steps/s in the fault run: {args.workers} workers / fewer", by_size)
        row("faults injected (recovered)", lambda k: f"{len(res[k].faults)} ({len(res[k].recoveries)})")
        row("recovery per fault, s: p50 / p95", recovery,
            lambda: "- (<= 0.1 s: bench/chaos_soak.py's job; one step here takes 0.1-0.2 s)")
        row("of which to training resumed (the rest: its first step), s: p50 / p95",
            lambda k: recovery(k, "resumes"))
        row("steps redone beyond the one in flight: total (per fault median, max)", redone,
            lambda: f"0 ({met(sum(res[e].redone) == 0)})")
        row("samples dropped", dropped, lambda: f"0 ({met(res[e].sample_count.dropped == 0)})")
        row("samples trained twice in the final model", lambda k: str(res[k].sample_count.repeated))
        row("final committed step", lambda k: str(res[k].final))
        row("worker processes started", lambda k: str(res[k].processes))
    titles = FSDP_TITLES if args.fsdp else TITLES
    lines = [f"| {args.workers} workers, commit/checkpoint every {args.commit_every} steps | "
             + " | ".join(titles[k] for k in args.launchers) + " | target (elastic-run) |",
             "| --- |" + " --- |" * (len(args.launchers) + 1)]
    lines += [f"| {name} | " + " | ".join(cells) + f" | {target} |" for name, cells, target in rows]
    return lines


@dataclass
class FaultRun:
    """One fault run of every system, and the fault-free runs it is measured against."""
    cycle: int
    every: float
    results: Dict[str, RunResult]
    before: Dict[str, RunResult]
    after: Dict[str, RunResult]

    def fault_free_rate(self, k: str) -> float:
        return (self.before[k].rate + self.after[k].rate) / 2


def spread_table(args, runs: List[FaultRun], fault_free: List[Dict[str, RunResult]]) -> List[str]:
    """Every cycle's goodput and useful samples ratio per system, each against the fault-free
    runs either side of its fault run, with their mean and range; the useful rate over the fault
    run's own rate at full size; and in how many cycles elastic-run met its goodput target."""
    cycles = max(r.cycle for r in runs) + 1
    lines = [f"| {cycles} cycles: each fault run against the fault-free runs either side | "
             + " | ".join(args.launchers) + " | target (elastic-run) |",
             "| --- |" + " --- |" * (len(args.launchers) + 1)]

    def cell(xs: List[float]) -> str:
        shown = ", ".join("-" if math.isnan(x) else f"{x:.2f}" for x in xs)
        xs = [x for x in xs if not math.isnan(x)]   # a fault run that never had every worker
        if not xs:
            return shown
        return shown + f" (mean {statistics.mean(xs):.2f}, range {min(xs):.2f}-{max(xs):.2f})"

    def row(name: str, fn, every: float, target: str = "-") -> None:
        xs = {k: [fn(r, k) for r in runs if r.every == every] for k in args.launchers}
        lines.append(f"| {name} | " + " | ".join(cell(xs[k]) for k in args.launchers) + f" | {target} |")

    def goodput(r: FaultRun, k: str) -> float:
        return r.results[k].useful_rate / r.fault_free_rate(k)

    def samples(r: FaultRun, k: str) -> float:
        return (r.results[k].samples / r.results[k].seconds) / (r.fault_free_rate(k) * args.workers * BATCH)

    def in_run(r: FaultRun, k: str) -> float:
        whole = r.results[k].by_size.get(args.workers)
        return r.results[k].useful_rate / whole if whole else float("nan")

    for every in args.every:
        target = goodput_target(every)
        hit = "-"
        if target and "elastic-run" in args.launchers:
            got = [goodput(r, "elastic-run") for r in runs if r.every == every]
            hit = f">= {target:g} (met in {sum(g >= target for g in got)} of {len(got)})"
        row(f"SIGKILL every {every:g} s: goodput", goodput, every, hit)
        row("useful samples / fault-free", samples, every)
        row(f"useful steps/s / the fault run's own steps/s at {args.workers} workers", in_run, every)
    lines.append("| fault-free steps/s, run by run | " + " | ".join(
        ", ".join(f"{ff[k].rate:.2f}" for ff in fault_free) for k in args.launchers) + " | - |")
    return lines


def load() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4, help="workers in the job (default 4)")
    ap.add_argument("--every", type=float, nargs="+", default=None, metavar="F",
                    help="seconds between SIGKILLs; several values make one fault run each (default 20 60; "
                         "--quick 10 20)")
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds of each fault run from its first step, T (default 300; --quick 30)")
    ap.add_argument("--fault-free-seconds", type=float, default=None,
                    help="length of each fault-free run (default 60; --quick 15)")
    ap.add_argument("--quick", action="store_true",
                    help="shorter defaults: F=10 and 20, T=30, fault-free runs of 15 s (7-10 minutes)")
    ap.add_argument("--plot", metavar="FILE.png", default=None,
                    help="also draw useful steps over time of every fault run, faults marked (matplotlib)")
    ap.add_argument("--commit-every", type=int, default=10,
                    help="steps between torchrun's checkpoints and elastic-run's commits (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the choice of victims (default 0)")
    ap.add_argument("--fsdp", action="store_true",
                    help="shard the model with FSDP2: torchrun with DCP checkpoints against elastic.ShardedState "
                         "(TorchFT is not part of this mode)")
    ap.add_argument("--start-timeout", type=float, default=180,
                    help="seconds a job may take to its first step (default 180)")
    ap.add_argument("--recovery-timeout", type=float, default=120,
                    help="give up on a run when a fault is not recovered within this many seconds (default 120)")
    ap.add_argument("--launchers", nargs="+", choices=LAUNCHERS, default=None,
                    help="which systems to run (default: all four; with --fsdp torchrun and elastic-run)")
    ap.add_argument("--preload", metavar="MODULES", default=None,
                    help="run elastic-run with --preload MODULES (e.g. torch): its workers and respawns are forked "
                         "from a process that imported them once (default: every worker a new process)")
    ap.add_argument("--repeat", type=int, default=1, metavar="K",
                    help="cycles of fault runs, with a fault-free run before, between and after them (each fault "
                         "run is measured against its neighbours); the goodput of every cycle is printed with "
                         "their mean and range (default 1)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory (event logs, launcher logs)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    defaults = ([10.0, 20.0], 30.0, 15.0) if args.quick else ([20.0, 60.0], 300.0, 60.0)
    for name, default in zip(("every", "duration", "fault_free_seconds"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, default)
    for v in args.every:
        if not (math.isfinite(v) and v > 0):
            ap.error(f"--every must be positive numbers of seconds, got {v:g}")
    args.every = sorted(set(args.every))
    if args.launchers is None:
        args.launchers = [k for k in LAUNCHERS if not (args.fsdp and k in TORCHFT)]
    if args.fsdp and any(k in TORCHFT for k in args.launchers):
        ap.error("--fsdp runs torchrun and elastic-run only: TorchFT's sharded mode (FT-HSDP) is not part of "
                 "this bench (leave torchft and torchft-defaults out of --launchers)")
    if args.workers < 3:
        ap.error("--workers must be at least 3 (elastic-run runs with --min-np 2 while a worker is respawned)")
    for name in ("duration", "fault_free_seconds", "start_timeout", "recovery_timeout"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v > 0):
            ap.error(f"--{name.replace('_', '-')} must be a positive number of seconds, got {v:g}")
    if args.commit_every < 1:
        ap.error("--commit-every must be at least 1")
    # Checked before a run of minutes, not after it.
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib: pip install -e '.[bench]'")
    if any(k in TORCHFT for k in args.launchers) and importlib.util.find_spec("torchft") is None:
        ap.error("the torchft systems need torchft-nightly: pip install -e '.[bench]' "
                 "(or leave them out: --launchers torchrun elastic-run)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: every run's finally takes its processes down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    out = tempfile.mkdtemp(prefix="bench-goodput-")
    print(f"# goodput{' (FSDP2)' if args.fsdp else ''}: {args.workers} workers, {os.cpu_count()} CPUs, load average {load()}; "
          f"commit/checkpoint every {args.commit_every} steps; run directory {out}"
          + (f"; elastic-run --preload {args.preload}" if args.preload else ""), flush=True)
    for line in configuration(args):
        print(f"# {line}")
    print(flush=True)
    # Without --repeat: a fault-free run, every fault run, a fault-free run. With it, a fault-free
    # run before, between and after every fault run: each is measured against its neighbours.
    runs: List[FaultRun] = []
    fault_free: List[Dict[str, RunResult]] = []

    def fault_free_run(label: str) -> Dict[str, RunResult]:
        fault_free.append({k: one(k, args, out, label) for k in args.launchers})
        return fault_free[-1]

    try:
        if args.repeat == 1:
            before = fault_free_run("fault-free-before")
            faulty = {(k, every): one(k, args, out, f"faults-{every:g}", every)
                      for every in args.every for k in args.launchers}
            after = fault_free_run("fault-free-after")
            runs = [FaultRun(0, every, {k: faulty[(k, every)] for k in args.launchers}, before, after)
                    for every in args.every]
        else:
            before = fault_free_run("fault-free-0")
            order = [(c, every) for c in range(args.repeat) for every in args.every]
            for i, (c, every) in enumerate(order):
                print(f"# cycle {c + 1} of {args.repeat}, a SIGKILL every {every:g} s, load average {load()}",
                      flush=True)
                got = {k: one(k, args, out, f"faults-{every:g}-cycle{c + 1}", every) for k in args.launchers}
                after = fault_free_run(f"fault-free-{i + 1}")
                runs.append(FaultRun(c, every, got, before, after))
                before = after
    except KeyboardInterrupt:
        print("# interrupted: every process of the run was stopped", flush=True)
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    print(f"# load average {load()} at end")
    if args.repeat == 1:
        print()
        for line in table(args, runs[0].before, runs[0].after,
                          {(k, r.every): r.results[k] for r in runs for k in args.launchers}):
            print(line)
    else:
        for r in runs:
            print()
            print(f"Cycle {r.cycle + 1} of {args.repeat}, a SIGKILL every {r.every:g} s:")
            print()
            one_every = argparse.Namespace(**{**vars(args), "every": [r.every]})
            for line in table(one_every, r.before, r.after, {(k, r.every): r.results[k] for k in args.launchers}):
                print(line)
        print()
        for line in spread_table(args, runs, fault_free):
            print(line)
    if args.plot:
        from _goodput_plot import plot

        plot(args.plot, args, {(k, r.every): r.results[k] for r in runs if r.cycle == 0 for k in args.launchers})
        print(f"# plot written to {args.plot}" + (" (the first cycle)" if args.repeat > 1 else ""))
    errors = [f"{res.launcher}: {res.error}" for group in (*fault_free, *(r.results for r in runs))
              for res in group.values() if res.error]
    for e in errors:
        print(f"# stopped early: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
