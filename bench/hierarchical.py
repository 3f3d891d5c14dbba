"""Is a hierarchical allreduce faster than the flat ring in a mixed world (2 hosts x 2 ranks)?

    sudo .venv/bin/python bench/hierarchical.py                        # 1, 16, 64 MiB; plain veth and 2gbit
    sudo .venv/bin/python bench/hierarchical.py --sizes 4M 64M --iters 9 --rate 1gbit
    sudo .venv/bin/python bench/hierarchical.py --rate none            # only the plain veth

Needs root: it creates two network namespaces ("hosts" a and b) joined by a veth pair and
runs 4 worker processes in them (ranks a0 a1 b0 b1) with `ip netns exec`; the namespaces
(and with them the veth) are deleted when it ends. Every worker forms, each on its own
listener: the flat 4-rank ring (hosts a,a,b,b: shared memory a0->a1 and b0->b1, TCP
a1->b0 and b1->a0), a local 2-rank ring per host (shared memory) and a cross 2-rank ring
per local rank (a0<->b0 and a1<->b1, TCP over the veth). Schedules, all allreduce Sum of
float32, composed in Python from those blocking collectives:

  flat    the 4-rank ring.
  h_rs    local reduce-scatter (emulated: a local allgather in which each rank sends the half
          its peer owns, then a numpy add of the half it owns), cross allreduce of the owned
          half (both local ranks in parallel, each on its own TCP connection), local in-place
          allgather of the halves.
  h_ar    local allreduce of the whole buffer (a reduce-scatter that keeps both halves),
          cross allreduce of the owned half (both in parallel), local in-place allgather.
  h_lead  local allreduce, the leaders (a0, b0) allreduce the whole buffer across, local
          broadcast from the leader.
  native  the core's own hierarchical allreduce (CommConfig(algorithm="hierarchical"), one
          communicator whose form() builds the flat, host-local and leaders' rings): the
          h_lead schedule inside one call, no Python between the phases.

The flat ring is the core's ring (algorithm="ring"). --schedules picks which run (default
flat h_lead native; "all" for every one).

Each condition (plain veth; then a tbf qdisc of --rate on both veth ends, to emulate a
network slower than memory) runs every size with the schedules interleaved round by round.
Time per iteration = the slowest rank's time from leaving a barrier to holding the result;
the table shows medians after one warm-up round. busbw = size/time * 2(n-1)/n with n = 4
for every schedule (so it compares like a time); "x" = flat time / that schedule's time
(above 1: hierarchical is faster). The "phases" lines give, per hierarchical schedule, the
median length of each of its three phases (local | cross | local) on the critical path
(phase k ends when the last rank ends it; the workers share one monotonic clock) and the
largest of them: roughly what a version that pipelined the phases could approach. The
tbf line adds the link-bound floor (size over --rate, 1.5x for flat, 1.0x for h_*; TCP/IP
headers make the real floor ~4% higher, the 256 KiB tbf burst a little lower for small
sizes). Inputs are integer-valued, so every sum is exact: each rank's result of each
schedule is checked bitwise against the reference sum ("check" column). Only elastic-ring's
schedules run here: gloo's allreduce against ours is bench/allreduce.py.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import threading
import time

from allreduce import human, parse_size  # bench/ is this script's directory: shared size helpers

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_hierarchical_worker.py")
ALL_SCHEDULES = ("flat", "h_rs", "h_ar", "h_lead", "native")
SCHEDULES = ("flat", "h_lead", "native")  # set from --schedules in main()
COMPOSED = ("h_rs", "h_ar", "h_lead")      # have per-phase marks


def rate_bytes(rate: str) -> float:
    """tc rate ('2gbit', '500mbit') in bytes per second."""
    r = rate.strip().lower()
    for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1)):
        if r.endswith(suffix):
            return float(r[: -len(suffix)]) * mult / 8
    raise ValueError(f"rate {rate!r}: use a tc rate such as 2gbit or 500mbit")


def ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)
    if res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")


class Worker:
    def __init__(self, g: int, ns: str, addr: str, pin: str):
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = ["ip", "netns", "exec", ns, sys.executable, WORKER, str(g), addr] + ([pin] if pin else [])
        self.g = g
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, obj) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float):
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"worker {self.g} gave no answer within {timeout:.0f} s") from None
        if line is None:
            raise RuntimeError(f"worker {self.g} exited (code {self.proc.wait()}); see its stderr above")
        return json.loads(line)


def measure(workers, sizes, iters, timeout):
    cmd = {"cmd": "run", "sizes": sizes, "iters": iters, "warmup": 1, "schedules": list(SCHEDULES)}
    for w in workers:
        w.send(cmd)
    per_rank = [w.recv(timeout)["results"] for w in workers]
    rows = []
    for nbytes in sizes:
        res = [r[str(nbytes)] for r in per_rank]
        med, bad, ph = {}, [], {}
        for s in SCHEDULES:
            if s in COMPOSED:
                # critical path: phase k ends when its last rank ends it (all ranks share CLOCK_MONOTONIC)
                per_it = []
                for i in range(iters):
                    ends = [max(r["phases"][s][i][k] for r in res) for k in range(len(res[0]["phases"][s][i]))]
                    per_it.append([b - a for a, b in zip(ends, ends[1:])])
                ph[s] = [statistics.median(it[k] for it in per_it) for k in range(len(per_it[0]))]
            # iteration time = slowest rank's time in that iteration
            its = [max(r["times"][s][i] for r in res) for i in range(iters)]
            med[s] = statistics.median(its)
            digests = {r["digest"][s] for r in res}
            if not all(r["ok"][s] for r in res) or len(digests) != 1 or digests != {res[0]["ref"]}:
                bad.append(s)
        rows.append((nbytes, med, bad, ph))
    return rows


def print_rows(cond: str, rows) -> None:
    n = 4
    factor = 2 * (n - 1) / n
    for nbytes, med, bad, _ in rows:
        line = f"{cond:>12} {human(nbytes):>8} |"
        for s in SCHEDULES:
            t = med[s]
            bus = nbytes / t / 1e9 * factor
            line += f" {t * 1e3:>8.2f} {bus:>6.2f}"
            line += " |" if s == "flat" else f" {med['flat'] / t:>5.2f}x |"
        line += " ok" if not bad else " MISMATCH: " + ",".join(bad)
        print(line, flush=True)


def print_phases(cond: str, rows) -> None:
    for nbytes, med, _, ph in rows:
        parts = []
        for s in [s for s in SCHEDULES if s in COMPOSED]:
            p = ph[s]
            parts.append(f"{s} {' + '.join(f'{x * 1e3:.1f}' for x in p)} (max {max(p) * 1e3:.1f})")
        if parts:
            print(f"#   phases {cond} {human(nbytes)}, ms local|cross|local: " + "; ".join(parts), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["1M", "16M", "64M"],
                    help="buffer sizes in bytes of float32, e.g. 1M 16M 64M (default)")
    ap.add_argument("--iters", type=int, default=7, help="timed iterations per size and schedule (default 7)")
    ap.add_argument("--rate", default="2gbit",
                    help="tbf rate for the slow-link condition, on both veth ends (default 2gbit); 'none': skip it")
    ap.add_argument("--schedules", nargs="+", default=["h_lead", "native"],
                    help=f"which of {' '.join(ALL_SCHEDULES)} to run, or 'all' (default: flat h_lead native)")
    ap.add_argument("--pin", action="store_true",
                    help="pin host a's ranks to CPU 0 and host b's to CPU 1 (hosts stop competing for cores)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench/hierarchical.py: needs root (it creates network namespaces and a veth pair)", file=sys.stderr)
        return 2
    if shutil.which("ip") is None or shutil.which("tc") is None:
        print("bench/hierarchical.py: needs iproute2 (ip and tc)", file=sys.stderr)
        return 2
    try:
        sizes = [parse_size(s) for s in args.sizes]
    except ValueError:
        ap.error(f"--sizes: cannot read {args.sizes}")
    if any(s < 16 or s % 8 for s in sizes):
        ap.error("--sizes: each size must be a multiple of 8 bytes, at least 16")
    if args.iters < 1:
        ap.error("--iters must be at least 1")
    global SCHEDULES
    chosen = ALL_SCHEDULES if args.schedules == ["all"] else tuple(args.schedules)
    if any(s not in ALL_SCHEDULES for s in chosen):
        ap.error(f"--schedules: choose from {' '.join(ALL_SCHEDULES)} or 'all'")
    SCHEDULES = ("flat",) + tuple(s for s in ALL_SCHEDULES[1:] if s in chosen)
    rate = None if args.rate.lower() == "none" else args.rate
    if rate is not None:
        try:
            rate_bytes(rate)
        except ValueError as e:
            ap.error(str(e))

    tag = f"{os.getpid() % 100000}"
    ns = (f"ehra{tag}", f"ehrb{tag}")
    veth = (f"vha{tag}", f"vhb{tag}")
    addr = ("10.231.78.1", "10.231.78.2")
    workers = []
    start = time.monotonic()
    try:
        for n in ns:
            ip("netns", "add", n)
            ip("-n", n, "link", "set", "lo", "up")
        ip("link", "add", veth[0], "netns", ns[0], "type", "veth", "peer", "name", veth[1], "netns", ns[1])
        for n, v, a in zip(ns, veth, addr):
            ip("-n", n, "addr", "add", f"{a}/24", "dev", v)
            ip("-n", n, "link", "set", v, "up")

        cpus = os.sched_getaffinity(0)
        pins = ["", "", "", ""]
        if args.pin:
            if len(cpus) < 2:
                ap.error("--pin needs 2 CPUs")
            c = sorted(cpus)
            pins = [str(c[0]), str(c[0]), str(c[1]), str(c[1])]
        workers = [Worker(g, ns[g // 2], addr[g // 2], pins[g]) for g in range(4)]
        addrs = [w.recv(60)["addrs"] for w in workers]
        for w in workers:
            w.send({"addrs": addrs})
        links = [w.recv(90)["links"] for w in workers]
        want_flat = [["shm", "tcp"], ["tcp", "shm"], ["shm", "tcp"], ["tcp", "shm"]]
        want_native = [[["shm", "shm"], ["tcp", "tcp"]], [["shm", "shm"], []]] * 2
        if [l["flat"] for l in links] != want_flat or any(l["local"] != ["shm", "shm"] or l["cross"] != ["tcp", "tcp"]
                                                           for l in links) or \
                [l["native"] for l in links] != want_native:
            raise RuntimeError(f"unexpected link kinds: {links}")

        print(f"# allreduce float32 Sum, 2 hosts x 2 ranks (netns + veth), {os.cpu_count()} CPUs"
              f"{' (host a pinned to one, host b to the other)' if args.pin else ' (unpinned)'}; "
              f"median of {args.iters} after 1 warm-up; ms = slowest rank; busbw GB/s = size/t*1.5; "
              f"x = flat ms / schedule ms")
        print("# links: flat a0->a1 shm, a1->b0 tcp, b0->b1 shm, b1->a0 tcp; local: shm; cross a0<->b0, a1<->b1: tcp")
        print("# h_rs = local reduce-scatter emulated by allgather+numpy add | cross allreduce of own half, both "
              "local ranks in parallel | local allgather")
        print("# h_ar = local allreduce (whole buffer) | cross allreduce of own half, in parallel | local allgather")
        print("# h_lead = local allreduce | leaders' cross allreduce of the whole buffer | local broadcast")
        print("# native = the core's hierarchical allreduce (algorithm='hierarchical'): h_lead in one native call")
        print("# flat = the core's ring (algorithm='ring')")
        head = f"{'condition':>12} {'size':>8} | {'flat ms':>8} {'busbw':>6} |"
        for s in SCHEDULES[1:]:
            head += f" {s + ' ms':>8} {'busbw':>6} {'x':>6} |"
        print(head + " check", flush=True)

        conditions = [("veth", None)] + ([(f"tbf {rate}", rate)] if rate else [])
        for cond, r in conditions:
            if r:
                for n, v in zip(ns, veth):
                    subprocess.run(["ip", "netns", "exec", n, "tc", "qdisc", "replace", "dev", v, "root", "tbf",
                                    "rate", r, "burst", "256kb", "latency", "50ms"],
                                   check=True, capture_output=True, timeout=15)
            rows = measure(workers, sizes, args.iters, timeout=600)
            print_rows(cond, rows)
            print_phases(cond, rows)
            if r:
                B = rate_bytes(r)
                bounds = ", ".join(f"{human(s)} flat {1.5 * s / B * 1e3:.0f} / hier {s / B * 1e3:.0f}"
                                   for s in sizes)
                print(f"#   link-bound floor at {r} per direction (flat sends 1.5x size each way across, "
                      f"h_* 1.0x): ms {bounds}", flush=True)
        for w in workers:
            w.send({"cmd": "quit"})
        for w in workers:
            w.proc.wait(timeout=30)
        print(f"# total {time.monotonic() - start:.0f} s")
        return 0
    except RuntimeError as e:
        print(f"bench/hierarchical.py: {e}", file=sys.stderr)
        return 1
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait(timeout=10)
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=15)


if __name__ == "__main__":
    sys.exit(main())
