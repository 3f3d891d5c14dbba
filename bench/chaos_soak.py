"""Soak: random SIGKILL/SIGSTOP on a respawning training job; prints recovery times and lost commits.

    python bench/chaos_soak.py --kills 50                 # 4 workers, about 70% SIGKILL, 30% SIGSTOP
    python bench/chaos_soak.py --kills 10 --workers 3 --stop-share 0.5 --seed 7
    python bench/chaos_soak.py --kills 50 --preempt       # SIGTERM: graceful leaves instead

With --preempt every fault is a SIGTERM (a preemption): the victim must leave at its next commit
and exit 0, and a new worker is started in its place. Printed per fault and in a table: the time
from the SIGTERM to the first step of the smaller world (target: one commit interval, as the
survivors' commit events measure it, plus 0.5 s), and the steps the survivors redid (target 0: a
leave restores nothing).

It starts a rendezvous server (in-memory store, heartbeat timeout --heartbeat-timeout) and
the chaos suite's training job (tests/elastic/job.py: a per-sample counter in the model,
state hashes, JSON event logs) on --workers processes. Then, --kills times: wait a random
0.5-2.5 s, pick a random worker and SIGKILL it (a new worker is started in its place) or
SIGSTOP it (it is sent SIGCONT once the others have recovered, and must come back as a new
member). Each fault is timed from the signal to the first step any other worker completes
in a newer world, and to the moment every other worker has completed one there (the last
survivor's first step: the recovery of the whole job). After the last fault the job is told
to stop at its next epoch boundary; then the same number of epochs runs again without faults,
for the loss to compare with.

Printed: faults survived, recovery p50/p95/max per signal (first survivor and every survivor;
targets: SIGKILL p95 <= 0.1 s on every survivor, SIGSTOP within 2/3 of the heartbeat
timeout + 0.2 s), commits lost (a sync at which
the ranks did not all load the newest commit any of them held), whether the final replicas
are bit-identical and every sample was counted, and the final loss against the fault-free
run. Exit status 1 if any of those fails or a recovery target is missed.

Also printed, per fault and in total (the targets of a failure that costs at most the step in
flight; reported, not yet part of the exit status):
  steps redone     steps a survivor trained again after the fault (it had completed them
                   before it; only a restore goes back), the most any survivor redid.
  samples dropped  from the job's per-sample counter in the final model: samples trained
                   fewer times than the epochs run. The counter holds the whole soak, so the
                   per-fault figure is that total divided by the faults.
  false evictions  workers the server evicted (its --events log) that were neither killed,
                   stopped nor sent SIGTERM by the soak.

Only elastic-ring runs here; how torchrun and TorchFT recover from a SIGKILL is measured by
bench/goodput.py, each in its documented configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rendezvous.server.server_config import ServerConfig  # noqa: E402
from tests.chaos.checks import lost_commits  # noqa: E402
from tests.rendezvous.rdzv_helpers import ServerProc  # noqa: E402
from tests.elastic.jobs import Job  # noqa: E402
from tests.waiting import wait_until  # noqa: E402


KILL_TARGET_S = 0.1   # SIGKILL -> the next step completed on every survivor, p95


def percentile95(xs) -> float:
    """The 95th percentile of ``xs`` (the nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def stop_target(args) -> float:
    """How soon a SIGSTOPped worker must be fenced: the server cuts it within 2/3 of the heartbeat
    timeout (a ping every third, a third to answer), plus 0.2 s to re-form and step (1 s at the
    default timeout)."""
    return 2 * args.heartbeat_timeout / 3 + 0.2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--kills", type=int, default=50, help="faults to inject (default 50)")
    p.add_argument("--workers", type=int, default=4, help="workers in the full world (default 4)")
    p.add_argument("--stop-share", type=float, default=0.3,
                   help="fraction of faults that are SIGSTOP rather than SIGKILL (default 0.3)")
    p.add_argument("--heartbeat-timeout", type=float, default=ServerConfig().heartbeat_timeout_s,
                   help="server heartbeat timeout T: a stopped worker is cut off within 2T/3 (default: the "
                        "server's, %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed for the fault schedule")
    p.add_argument("--preempt", action="store_true",
                   help="every fault is a SIGTERM: a graceful leave at the next commit (see above)")
    p.add_argument("--recovery-timeout", type=float, default=30.0,
                   help="give up when a fault is not recovered within this many seconds (default 30)")
    args = p.parse_args(argv)
    if args.kills < 1 or args.workers < 2 or not 0 <= args.stop_share <= 1:
        p.error("need --kills >= 1, --workers >= 2 and 0 <= --stop-share <= 1")
    return args


class Soak:
    def __init__(self, args, out: str):
        self.args = args
        self.out = out
        self.rng = random.Random(args.seed)
        # Every worker runs on this one host and is killed on purpose: no host blacklisting.
        self.server_events = os.path.join(out, "server-events.jsonl")
        self.server = ServerProc(_Path(out), "--insecure", "--heartbeat-timeout", str(args.heartbeat_timeout),
                                 "--settle", "0.2", "--blacklist-after", "0", "--events", self.server_events)
        self.stop_file = os.path.join(out, "stop")
        self.job = Job(_Path(out), self.server.address, forked=False, min_np=1, max_np=args.workers, JOB_EPOCHS=100000,
                       JOB_STEP_SLEEP=0.02, JOB_STOP_FILE=self.stop_file, ELASTIC_WORLD_TIMEOUT=120)
        self.live: list[str] = []
        self.spawned = 0
        self.recoveries = {"SIGKILL": [], "SIGSTOP": []}
        self.every_recovered = {"SIGKILL": [], "SIGSTOP": []}   # the last survivor's first step
        self.shrinks: list = []          # --preempt: seconds from SIGTERM to the smaller world
        self.leaver_codes: list = []     # --preempt: exit status of every worker sent SIGTERM
        self.victims: set = set()        # every worker the soak signalled
        self.redone: list = []           # per fault: the most steps a survivor trained again
        self.failure = ""

    def spawn(self) -> str:
        w = f"w{self.spawned}"
        self.spawned += 1
        self.job.start(w)
        self.live.append(w)
        return w

    def full_world(self, after_version: int = 0) -> bool:
        """Some worker stepped in a world of the full size newer than `after_version`."""
        return any(size == self.args.workers and version > after_version
                   for size, version in ((p[1], p[2]) for p in map(self.job.progress, self.live) if p))

    def first_steps(self, victim: str, t_fault: float, version: int, smaller: bool = False):
        """Each other worker's first step after `t_fault` in a world newer than `version` (and,
        with `smaller`, of fewer than --workers workers): worker -> its time, or None."""
        out = {}
        for w in self.live:
            if w == victim:
                continue
            out[w] = next((e["t"] for e in self.job.events(w)
                           if e["ev"] == "step" and e["t"] > t_fault and e["v"] > version
                           and (not smaller or e["size"] < self.args.workers)), None)
        return out

    def recovered_at(self, victim: str, t_fault: float, version: int, smaller: bool = False):
        """Time of the first step another worker completed in a world newer than `version` (and,
        with `smaller`, of fewer than --workers workers)."""
        return min((t for t in self.first_steps(victim, t_fault, version, smaller).values() if t is not None),
                   default=None)

    def all_recovered_at(self, victim: str, t_fault: float, version: int):
        """Time by which every other worker completed a step in a world newer than `version`
        (None while one has not)."""
        firsts = list(self.first_steps(victim, t_fault, version).values())
        return None if None in firsts else max(firsts, default=0.0)

    def redone_since(self, victim: str, t_fault: float) -> int:
        """The most steps a survivor completed again after ``t_fault`` (it had completed them before)."""
        most = 0
        for w in self.live:
            if w == victim:
                continue
            steps = [e for e in self.job.events(w) if e["ev"] == "step"]
            top = max((e["step"] for e in steps if e["t"] <= t_fault), default=0)
            most = max(most, sum(1 for e in steps if e["t"] > t_fault and e["step"] <= top))
        return most

    def preempt(self, n: int) -> None:
        victim = self.rng.choice(self.live)
        self.victims.add(victim)
        version = max((e["v"] for w in self.live for e in self.job.events(w) if e["ev"] == "step"), default=0)
        t_fault = time.time()
        self.job.kill(victim, signal.SIGTERM)
        t = wait_until(lambda: self.recovered_at(victim, t_fault, version, smaller=True), self.args.recovery_timeout,
                       f"the world to shrink after SIGTERM to {victim}", interval=0.1)
        try:
            code = self.job.procs[victim].wait(self.args.recovery_timeout)
        except Exception:
            code = None
        self.leaver_codes.append(code)
        self.shrinks.append(t - t_fault)
        print(f"fault {n:3d}: SIGTERM {victim:>4} in world {version:3d} -> smaller world in {t - t_fault:6.3f} s, "
              f"exit status {code}", flush=True)
        recovered_version = max(e["v"] for w in self.live if w != victim for e in self.job.events(w)
                                if e["ev"] == "step")
        self.redone.append(self.redone_since(victim, t_fault))
        self.live.remove(victim)
        self.spawn()
        wait_until(lambda: self.full_world(recovered_version), 60,
                   f"the world to grow back to {self.args.workers}")

    def inject(self, n: int) -> None:
        if self.args.preempt:
            return self.preempt(n)
        sig = signal.SIGSTOP if self.rng.random() < self.args.stop_share else signal.SIGKILL
        victim = self.rng.choice(self.live)
        self.victims.add(victim)
        # The world at the fault: the newest any worker has stepped in.
        version = max((e["v"] for w in self.live for e in self.job.events(w) if e["ev"] == "step"), default=0)
        t_fault = time.time()
        self.job.kill(victim, sig)
        name = signal.Signals(sig).name
        # Polled every 0.1 s (each poll reads the event logs); the time itself comes from the logs.
        t = wait_until(lambda: self.recovered_at(victim, t_fault, version), self.args.recovery_timeout,
                       f"recovery from {name} of {victim}", interval=0.1)
        t_all = wait_until(lambda: self.all_recovered_at(victim, t_fault, version), self.args.recovery_timeout,
                           f"every survivor stepping after {name} of {victim}", interval=0.1)
        recovered_version = max(e["v"] for w in self.live if w != victim for e in self.job.events(w)
                                if e["ev"] == "step")
        self.recoveries[name].append(t - t_fault)
        self.every_recovered[name].append(t_all - t_fault)
        # Redone steps follow the restore at once: counted when the survivors step in the new world.
        redone = self.redone_since(victim, t_fault)
        self.redone.append(redone)
        print(f"fault {n:3d}: {name} {victim:>4} in world {version:3d} -> recovered in {t - t_fault:6.3f} s "
              f"(every survivor {t_all - t_fault:6.3f} s), {redone} steps redone", flush=True)
        if sig == signal.SIGKILL:
            self.job.procs[victim].wait(10)
            self.live.remove(victim)
            self.spawn()
        else:
            self.job.kill(victim, signal.SIGCONT)  # evicted by now: it must rejoin as a new member
        wait_until(lambda: self.full_world(recovered_version), 60,
                   f"the world to grow back to {self.args.workers}")

    def run(self) -> int:
        for _ in range(self.args.workers):
            self.spawn()
        wait_until(lambda: all(self.job.progress(w) for w in self.live) and self.full_world(), 120,
                   "the job to start")
        for n in range(1, self.args.kills + 1):
            time.sleep(self.rng.uniform(0.5, 2.5))  # the gap between faults is the schedule itself
            try:
                self.inject(n)
            except AssertionError as e:  # not recovered (or not regrown) in time: stop and report
                print(f"fault {n:3d}: {e}", flush=True)
                self.failure = str(e)
                break
        with open(self.stop_file, "w"):
            pass
        try:
            codes = self.job.wait(self.live, timeout=120)
        except AssertionError as e:
            print(e, flush=True)
            self.failure = self.failure or "the job did not finish"
            codes = {w: self.job.procs[w].poll() for w in self.live}
        return self.report(codes)

    def report(self, codes) -> int:
        results = [self.job.result(w) for w in self.live if codes[w] == 0]
        events = {w: self.job.events(w) for w in self.job.procs}
        lost = lost_commits(events)
        epochs = results[0]["epochs"] if results else 0
        identical = len({r["hash"] for r in results}) == 1 and len(results) == len(self.live)
        # Every sample once per epoch; repeats only from padding: at most size-1 per world.
        worlds = {e["v"] for evs in events.values() for e in evs if e["ev"] == "sync"}
        pad_bound = len(worlds) * (self.args.workers - 1)
        counted = bool(results) and all(
            min(r["seen"]) >= r["epochs"] and sum(r["seen"]) - r["epochs"] * len(r["seen"]) <= pad_bound
            for r in results)
        ff_loss = fault_free_loss(self.out, self.args.workers, epochs)
        loss = max(r["loss"] for r in results) if results else float("nan")
        initial = results[0]["initial_loss"] if results else float("nan")
        loss_ok = loss <= 100 * ff_loss + 1e-7 * initial  # as in tests/chaos/checks.py

        def dist(xs):
            if not xs:
                return "-", "-", "-"
            return f"{statistics.median(xs):.3f}", f"{percentile95(xs):.3f}", f"{max(xs):.3f}"

        survived = sum(len(v) for v in self.recoveries.values()) + len(self.shrinks)
        print()
        print(f"faults survived: {survived}/{self.args.kills}")
        preempt_ok = True
        if self.args.preempt:
            interval = commit_interval(events)
            redone = steps_redone(events)
            target = interval + 0.5
            p50, p95, mx = dist(self.shrinks)
            clean = sum(1 for c in self.leaver_codes if c == 0)
            print("| SIGTERMs | leavers exit 0 | to smaller world p50 s | p95 s | max s | target (commit interval "
                  "+ 0.5 s) | steps redone by survivors (target 0) |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            print(f"| {len(self.shrinks)} | {clean} | {p50} | {p95} | {mx} | <= {interval:.3f} + 0.5 = {target:.3f} s "
                  f"| {redone} |")
            preempt_ok = (redone == 0 and clean == len(self.leaver_codes) and bool(self.shrinks)
                          and max(self.shrinks) <= target)
        else:
            print("| signal | faults | first survivor stepping: p50 s | p95 s | max s | every survivor: p50 s | "
                  "p95 s | max s | target |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
            for name, target in (("SIGKILL", f"every survivor p95 <= {KILL_TARGET_S:g} s"),
                                 ("SIGSTOP", f"<= 2/3 heartbeat timeout + 0.2 = {stop_target(self.args):.2f} s")):
                p50, p95, mx = dist(self.recoveries[name])
                a50, a95, amx = dist(self.every_recovered[name])
                print(f"| {name} | {len(self.recoveries[name])} | {p50} | {p95} | {mx} | {a50} | {a95} | {amx} | "
                      f"{target} |")
        dropped = sum(max(0, epochs - int(s)) for s in results[0]["seen"]) if results else 0
        false = false_evictions(self.server_events, self.victims)
        faults = len(self.redone)
        print("| faults | steps redone per fault p50 | max | total (target 0) | samples dropped, total "
              "(per fault) (target 0) | false evictions (target 0) |")
        print("| --- | --- | --- | --- | --- | --- |")
        print(f"| {faults} | {statistics.median(self.redone) if self.redone else '-'} | "
              f"{max(self.redone) if self.redone else '-'} | {sum(self.redone)} | "
              f"{dropped} ({dropped / faults if faults else 0:.1f}) | {len(false)}"
              + (f": {', '.join(sorted(false))}" if false else "") + " |")
        print(f"commits lost: {len(lost)}" + "".join(f"\n  {p}" for p in lost))
        print(f"workers finished: {len(results)}/{len(self.live)} (exit codes {codes}); epochs {epochs}; "
              f"replicas bit-identical: {identical}; every sample counted, repeats <= {pad_bound}: {counted}")
        print(f"final loss {loss:.3g} vs fault-free {ff_loss:.3g} (initial {initial:.3g}): "
              f"{'as good' if loss_ok else 'WORSE'}")
        kills, stops = self.every_recovered["SIGKILL"], self.recoveries["SIGSTOP"]
        targets = ((not kills or percentile95(kills) <= KILL_TARGET_S)
                   and (not stops or max(stops) <= stop_target(self.args)) and preempt_ok)
        print(f"targets met: {targets}" + (f"; stopped early: {self.failure}" if self.failure else ""))
        ok = (survived == self.args.kills and not self.failure and not lost and identical and counted
              and loss_ok and targets)
        return 0 if ok else 1

    def close(self) -> None:
        self.job.close()
        self.server.kill()


def false_evictions(path: str, victims: set) -> set:
    """Workers the server's event log shows evicted that the soak never signalled."""
    evicted = set()
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    e = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(e, dict) and e.get("event") == "worker_evicted" and isinstance(e.get("worker_id"), str):
                    evicted.add(e["worker_id"])
    except OSError:
        pass
    return evicted - victims


def commit_interval(events) -> float:
    """Median seconds between two commits of one worker in one world (the boundary a leave waits for)."""
    gaps = []
    for evs in events.values():
        commits = [e for e in evs if e["ev"] == "commit"]
        gaps += [b["t"] - a["t"] for a, b in zip(commits, commits[1:]) if a["v"] == b["v"]]
    return statistics.median(gaps) if gaps else float("nan")


def steps_redone(events) -> int:
    """Steps a worker trained again after it had trained them (only a restore goes back)."""
    redone = 0
    for evs in events.values():
        top = 0
        for e in evs:
            if e["ev"] == "step":
                if e["step"] <= top:
                    redone += 1
                top = max(top, e["step"])
    return redone


def fault_free_loss(out: str, workers: int, epochs: int) -> float:
    base = os.path.join(out, "fault-free")
    os.makedirs(base, exist_ok=True)
    server = ServerProc(_Path(base), "--insecure")
    job = Job(_Path(base), server.address, forked=False, min_np=workers, max_np=workers, JOB_EPOCHS=max(epochs, 1),
              JOB_STEP_SLEEP=0)
    try:
        names = [f"f{i}" for i in range(workers)]
        for w in names:
            job.start(w)
        codes = job.wait(names, timeout=600)
        if any(codes.values()):
            raise RuntimeError(f"the fault-free run failed: {codes}")
        return job.result(names[0])["loss"]
    finally:
        job.close()
        server.kill()


class _Path(str):
    """ServerProc wants a pathlib-like `tmp / name`."""

    def __truediv__(self, name):
        return os.path.join(self, name)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = tempfile.mkdtemp(prefix="chaos-soak-")
    print(f"chaos soak: {args.kills} faults on {args.workers} workers (SIGSTOP share {args.stop_share:g}, "
          f"heartbeat timeout {args.heartbeat_timeout:g} s, seed {args.seed}); logs in {out}", flush=True)
    soak = Soak(args, out)
    try:
        return soak.run()
    finally:
        soak.close()


if __name__ == "__main__":
    sys.exit(main())
