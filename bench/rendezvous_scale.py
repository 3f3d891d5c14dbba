"""Scale benchmark of the rendezvous service: N simulated workers join one job on the etcd-backed server.

For each N it prints: time from the last join until every worker holds the same world; time from
killing 1% of the workers (their connections drop, as on a crash) until every survivor holds the next
world; the server's CPU time and peak memory (it runs as its own process against a local etcd); the
bytes of World messages sent for one world change (the re-form), in all and to the worker that got
the most; the bytes the server sent etcd for that change (etcd's own count of what its clients sent
it); and the exponent of server CPU per world change against N, fitted over the sizes (1: linear).
With --liveness it also compares the server's CPU cost of keeping N idle workers alive with HTTP/2
keepalive only (the design) against a unary RPC per worker per second, as Python heartbeats would
be (the alternative; ReportProgress stands in for one).

    python bench/rendezvous_scale.py                    # N = 1024, 4096, 16384
    python bench/rendezvous_scale.py --sizes 64,128 --liveness
    python bench/rendezvous_scale.py --sizes 1024 --repo ../main   # another checkout's server
    BENCH_PYSPY=/tmp/spy python bench/rendezvous_scale.py --sizes 16384   # py-spy samples of the re-form
    python bench/rendezvous_stream_share.py /tmp/spy/reform-server.txt    # ... split per stream / the rest

How the simulation differs from real workers: every worker is a grpc.aio client in this one
process (no ring, no training) that acknowledges an abort where it asks (worlds of up to 512),
as a RendezvousClient does (--no-abort-acks: never); up to 1,024 workers each get their own
channel (TCP connection), beyond that workers share channels (N/1,024 Watch streams per HTTP/2
connection), because one process on this 2-core machine cannot hold 16,384 connections and
their keepalive pings. The server sees the same RPCs and streams per worker, but fewer
connections and pings than N real processes would give it. A worker's time is when its own
message was read; the bench waits for them all through one tally, not a task per worker (see
Tally). That one process joins 128 workers at a time, each joined once its Watch got its first
event, and it shares the 2 cores with the server and etcd, so the server runs with a heartbeat
timeout of 30 s and a leader lease of 10 s (instead of 1.2 s and 2 s); a killed worker is still
seen at once, by its stream breaking. The joins take this process ~35 s at 16,384, so the
server's --settle-max is 60 s: the first world forms once the joins stop, as for workers
started together (with the default 2 s it forms at min_np and then grows as the last ones
trickle in, each late one a world more, which measures this one process, not the server).
Bytes are the serialized WatchEvent messages (gRPC adds 5 bytes of framing to each, HTTP/2 a
few more). Targets at N = 16,384: form <= 3 s, re-form <= 2 s,
<= 4 KiB per worker per world change, CPU exponent <= 1.1. Only our server runs here: no peer.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
MAX_CHANNELS = 1024

import grpc  # noqa: E402
from grpc import aio  # noqa: E402

from rendezvous.wire.messages import pb, pb_grpc  # noqa: E402
from rendezvous.common.channel import channel_options  # noqa: E402
from rendezvous.server.etcd_process import EtcdProcess  # noqa: E402

TIMEOUT_S = 120.0


class Server:
    """`python -m rendezvous serve` against etcd, in its own process so its CPU/memory are its own."""

    def __init__(self, tmp: str, etcd: str, prefix: str, repo: str):
        port_file = os.path.join(tmp, f"port-{prefix.strip('/')}")
        env = dict(os.environ, PYTHONPATH=repo)
        # `-m rendezvous` of `repo`, not of an editable install of this checkout (whose import
        # finder would otherwise come first).
        start = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path "
                 "if not type(f).__module__.startswith('_editable')]; sys.path.insert(0, sys.argv[1]); "
                 "sys.argv[1:2] = []; runpy.run_module('rendezvous', run_name='__main__', alter_sys=True)")
        if os.environ.get("BENCH_SERVER_PROFILE"):   # cProfile of the server, written when it stops
            start = (f"import cProfile; cProfile.run({start!r}, {os.environ['BENCH_SERVER_PROFILE']!r})")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", start, repo, "serve", "--host", "127.0.0.1", "--port", "0",
             "--port-file", port_file, "--etcd", etcd, "--etcd-prefix", prefix, "--insecure",
             "--leader-ttl", "10", "--heartbeat-timeout", "30", "--settle-max", "60",
             "--log-level", os.environ.get("BENCH_SERVER_LOG", "WARNING")], cwd=repo, env=env)
        deadline = time.monotonic() + 30
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("rendezvous server did not start")
            time.sleep(0.02)
        self.address = f"127.0.0.1:{open(port_file).read()}"

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if os.environ.get("BENCH_SERVER_PROFILE"):
            self.proc.send_signal(2)   # KeyboardInterrupt: the profile is written on the way out
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def etcd_received_bytes(client_url: str) -> float:
    """What etcd's clients have sent it so far (its etcd_network_client_grpc_received_bytes_total)."""
    import urllib.request
    with urllib.request.urlopen(f"{client_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r"^etcd_network_client_grpc_received_bytes_total ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


class Tally:
    """Which workers hold the world being waited for: one waiter for all of them. (A task per worker
    waiting on its own event, 16,384 of them created as the workers are killed, cost this process
    ~0.85 s of CPU at the moment the server re-forms, on the 2 cores it shares with it; a real worker
    spends nothing of the kind on anyone else's core.)"""

    def __init__(self):
        self.want: Optional[tuple[int, int]] = None   # (size, after): a world of `size` after `after`
        self.holding: set = set()
        self.expected = 0
        self.reached = asyncio.Event()

    def heard(self, worker: "Worker", version: int, size: int) -> None:
        if self.want is not None and size == self.want[0] and version > self.want[1]:
            self.holding.add(worker)
            if len(self.holding) >= self.expected:
                self.reached.set()

    async def wait(self, workers: list, size: int, after: int, deadline: float) -> None:
        self.want, self.expected, self.reached = (size, after), len(workers), asyncio.Event()
        self.holding = {w for w in workers if w.first_world(size, after) is not None}
        if len(self.holding) < self.expected:
            await asyncio.wait_for(self.reached.wait(), max(0.01, deadline - time.monotonic()))
        self.want = None


class Worker:
    def __init__(self, channel, job: str, i: int, n: int, min_np: int, tally: "Tally"):
        self.i, self.min_np, self.tally = i, min_np, tally
        # The same options as a RendezvousClient: its keepalive pings are part of the server's load.
        self.channel = channel
        self.stub = pb_grpc.RendezvousStub(self.channel)
        # Watch as raw bytes: what was sent is measured as sent, whichever version the server is.
        self.raw_watch = self.channel.unary_stream("/elastic.rendezvous.v1.Rendezvous/Watch",
                                                   request_serializer=pb.WatchRequest.SerializeToString,
                                                   response_deserializer=None)
        self.job, self.n = job, n
        self.worlds: dict[int, tuple[float, int]] = {}   # version -> (time received, size)
        self.world_bytes: dict[int, int] = {}            # version -> bytes of its World message
        self.opened = asyncio.Event()
        self.task = None
        self.session = ""
        self.ack_aborts = True
        self.acks: set = set()

    async def join(self) -> float:
        request = pb.JoinRequest(job_id=self.job, worker_id=f"w{self.i:05d}", host=f"host{self.i // 8}",
                                 ring_address=f"127.0.0.1:{10000 + self.i}", commit_step=-1,
                                 spec=pb.JobSpec(min_np=self.min_np, max_np=self.n))
        give_up = time.monotonic() + 60   # as a RendezvousClient does: a transient failure is tried again
        while True:
            try:
                resp = await self.stub.Join(request, timeout=TIMEOUT_S)
                break
            except grpc.RpcError as e:
                if time.monotonic() > give_up or e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                                                   grpc.StatusCode.CANCELLED):
                    raise
                await asyncio.sleep(0.5)
        self.session = resp.session_id
        self.task = asyncio.get_running_loop().create_task(self._watch())
        # Joined means watching, as for a worker process, which opens its Watch at once.
        await asyncio.wait_for(self.opened.wait(), TIMEOUT_S)
        return time.monotonic()

    async def _watch(self) -> None:
        try:
            async for data in self.raw_watch(pb.WatchRequest(session_id=self.session)):
                ev = pb.WatchEvent.FromString(data)
                self.opened.set()   # the first event: its snapshot (a Standby notice or the world)
                kind = ev.WhichOneof("event")
                if kind == "world":
                    self.worlds[ev.world.world_version] = (time.monotonic(), ev.world.size)
                    self.world_bytes[ev.world.world_version] = len(data)
                    self.tally.heard(self, ev.world.world_version, ev.world.size)
                abort = ev.abort if kind == "abort" else ev.world.aborted if kind == "world" else None
                if abort is not None and abort.acknowledge and self.ack_aborts:
                    # As a RendezvousClient does: acknowledged at once when the abort asks (a small
                    # world), so the next world need not wait out the server's settle window.
                    task = asyncio.get_running_loop().create_task(self._ack(abort.world_version))
                    self.acks.add(task)
                    task.add_done_callback(self.acks.discard)
        except (grpc.RpcError, asyncio.CancelledError):
            pass

    async def _ack(self, world_version: int) -> None:
        try:
            await self.stub.AcknowledgeAbort(pb.AcknowledgeAbortRequest(
                session_id=self.session, world_version=world_version), timeout=TIMEOUT_S)
        except grpc.RpcError:
            pass   # as a worker: a lost acknowledgement costs the settle window, nothing more

    def first_world(self, size: int, after: int) -> Optional[tuple[int, float]]:
        """(version, time received) of the first world of `size` members after version `after`."""
        for v, (t, s) in sorted(self.worlds.items()):
            if s == size and v > after:
                return v, t
        return None

    async def crash(self) -> None:
        """Drop the connection without leaving, as a killed process would (a victim has its own)."""
        await self.channel.close(grace=None)

    async def heartbeat_forever(self, period_s: float) -> None:
        while True:
            # What a Python heartbeat would cost the server: one unary RPC of this session.
            await self.stub.ReportProgress(pb.ReportProgressRequest(session_id=self.session,
                                                                    commit_step=-1), timeout=TIMEOUT_S)
            await asyncio.sleep(period_s)


async def run_size(server: Server, etcd_url: str, n: int, liveness: bool, kill_percent: float,
                   min_np_all: bool, abort_acks: bool = True) -> dict:
    job = f"bench-{n}"
    victims_n = max(1, round(n * kill_percent / 100))
    min_np = n - victims_n if min_np_all else 1   # the survivors are enough to go on
    per_channel = max(1, -(-n // MAX_CHANNELS))
    channels = []

    def channel():
        channels.append(aio.insecure_channel(server.address, options=channel_options()))
        return channels[-1]
    # Victims get a connection each (killing one drops only it); the rest share theirs.
    tally = Tally()
    workers = [Worker(channel(), job, i, n, min_np, tally) for i in range(victims_n)]
    shared = None
    for i in range(victims_n, n):
        if (i - victims_n) % per_channel == 0:
            shared = channel()
        workers.append(Worker(shared, job, i, n, min_np, tally))
    for w in workers:
        w.ack_aborts = abort_acks
    cpu0 = server.cpu_s()
    sem = asyncio.Semaphore(128)  # bound in-flight joins, like a launcher ramping up

    async def join(w):
        async with sem:
            return await w.join()
    last_join = max(await asyncio.gather(*(join(w) for w in workers)))
    deadline = time.monotonic() + TIMEOUT_S
    got = await _all_hold(tally, workers, n, deadline, 0, "the full world")
    versions = {v for v, _ in got}
    assert len(versions) == 1, f"workers disagree on the full world: {versions}"
    form_s = max(t for _, t in got) - last_join
    cpu_join = server.cpu_s() - cpu0

    result = {"n": n, "form_s": form_s, "cpu_join_s": cpu_join, "per_channel": per_channel}
    if liveness:
        result.update(await idle_cost(server, workers))

    victims = workers[:victims_n]
    survivors = workers[victims_n:]
    cpu1 = server.cpu_s()
    etcd1 = etcd_received_bytes(etcd_url)
    spies = _spy_on([server.proc.pid, os.getpid()], "reform")
    killed_at = time.monotonic()
    await asyncio.gather(*(v.crash() for v in victims))
    deadline = time.monotonic() + TIMEOUT_S
    formed = max(versions)
    got = await _all_hold(tally, survivors, len(survivors), deadline, formed, "the next world")
    versions = {v for v, _ in got}
    assert len(versions) == 1, "survivors disagree on the next world"
    result["recover_s"] = max(t for _, t in got) - killed_at
    _stop_spies(spies)
    await asyncio.sleep(0.5)   # the server's last writes of this change (acknowledgements ride along)
    result["cpu_recover_s"] = server.cpu_s() - cpu1
    result["etcd_bytes"] = etcd_received_bytes(etcd_url) - etcd1
    (version,) = versions
    sent = [w.world_bytes[version] for w in survivors]
    result["world_bytes_total"], result["world_bytes_max"] = sum(sent), max(sent)
    for w in workers:
        if w.task is not None:
            w.task.cancel()
    for c in channels:
        await c.close(grace=None)
    return result


def _spy_on(pids: list, phase: str) -> list:
    """With BENCH_PYSPY=<folder>, py-spy (on PATH) samples the server and this process during
    `phase`, one file of collapsed stacks per process; otherwise nothing."""
    folder = os.environ.get("BENCH_PYSPY")
    if not folder:
        return []
    procs = [subprocess.Popen(["py-spy", "record", "-p", str(pid), "-r", "200", "--format", "raw",
                               "-o", os.path.join(folder, f"{phase}-{'server' if i == 0 else 'client'}.txt")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i, pid in enumerate(pids)]
    time.sleep(1.0)   # py-spy attaches
    return procs


def _stop_spies(procs: list) -> None:
    for p in procs:
        p.send_signal(2)   # py-spy writes its samples on SIGINT
    for p in procs:
        p.wait(30)


async def _all_hold(tally: Tally, workers: list, size: int, deadline: float, after: int, what: str) -> list:
    """Each worker's (version, time) of its first world of `size` after `after`; on a timeout, an
    error that says which worlds the workers did hold (the last each heard of)."""
    try:
        await tally.wait(workers, size, after, deadline)
        return [w.first_world(size, after) for w in workers]
    except asyncio.TimeoutError:
        held: dict = {}
        for w in workers:
            last = max(w.worlds.items(), default=None)
            key = "no world" if last is None else f"world {last[0]} of {last[1][1]}"
            held[key] = held.get(key, 0) + 1
        raise TimeoutError(f"{what} of {size} not held by every worker within {TIMEOUT_S:g} s; "
                           f"the last world each holds: {held}") from None


async def idle_cost(server: Server, workers: list, seconds: float = 5.0) -> dict:
    """Server CPU while N workers sit idle: keepalive only, then with 1 Hz heartbeat-like RPCs."""
    c0 = server.cpu_s()
    await asyncio.sleep(seconds)
    keepalive = (server.cpu_s() - c0) / seconds
    tasks = [asyncio.get_running_loop().create_task(w.heartbeat_forever(1.0)) for w in workers]
    await asyncio.sleep(1.0)  # let the heartbeats spread out
    c1 = server.cpu_s()
    await asyncio.sleep(seconds)
    heartbeats = (server.cpu_s() - c1) / seconds
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"idle_keepalive_cpu": keepalive, "idle_heartbeat_cpu": heartbeats}


def fitted_exponent(rows: list, key: str) -> float:
    """The slope of log(rows[key]) against log(N), least squares (1.0: grows as N)."""
    xs = [math.log(r["n"]) for r in rows]
    ys = [math.log(max(r[key], 1e-3)) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1024,4096,16384", help="comma-separated N (default: %(default)s)")
    p.add_argument("--kill-percent", type=float, default=1.0,
                   help="workers killed at once for the re-form, in %% of N (at least one; default %(default)s)")
    p.add_argument("--min-np", choices=("survivors", "1"), default="survivors",
                   help="the job's min_np: the number that survive the kill (the world forms once nearly "
                        "all joined; default) or 1 (a world forms, and grows, while workers join)")
    p.add_argument("--repo", default=REPO, help="the checkout whose server runs (default: this one)")
    p.add_argument("--no-abort-acks", action="store_true",
                   help="simulated workers do not acknowledge aborts, even where asked (as real ones do)")
    p.add_argument("--liveness", action="store_true",
                   help="also measure the idle CPU cost of keepalive vs 1 Hz heartbeats")
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * max(sizes) + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        etcd = EtcdProcess(tmp)
        try:
            for n in sizes:
                # A fresh server per size, so its peak memory belongs to that size.
                server = Server(tmp, etcd.endpoint, f"/bench-{n}-{os.getpid()}", os.path.abspath(a.repo))
                try:
                    r = asyncio.run(run_size(server, etcd.client_url, n, a.liveness, a.kill_percent,
                                             a.min_np == "survivors", not a.no_abort_acks))
                    r["peak_mib"] = server.peak_rss_mib()
                    r["cpu_total_s"] = server.cpu_s()
                finally:
                    server.stop()
                rows.append(r)
                print(f"N={n}: done", file=sys.stderr, flush=True)
        finally:
            etcd.stop()
    head = (f"| N | last join → same world (s) | kill {a.kill_percent:g}% → next world (s) | server CPU: joins (s) |"
            " server CPU: re-form (s) | server CPU total (s) | server peak RSS (MiB) |"
            " World bytes per change: total | per worker (max) | etcd bytes per change |")
    print(head)
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['form_s']:.2f} | {r['recover_s']:.2f} | {r['cpu_join_s']:.2f} | "
              f"{r['cpu_recover_s']:.2f} | {r['cpu_total_s']:.2f} | {r['peak_mib']:.0f} | "
              f"{r['world_bytes_total']:,} | {r['world_bytes_max']:,} | {r['etcd_bytes']:,.0f} |")
    if len(rows) >= 2:
        for key, what in (("cpu_recover_s", "server CPU per world change (re-form)"),
                          ("cpu_join_s", "server CPU of the joins and first world")):
            print(f"fitted exponent of {what} against N: {fitted_exponent(rows, key):.2f}")
    if a.liveness:
        print()
        print("| N | idle server CPU, keepalive only (cores) | idle server CPU, 1 Hz heartbeats (cores) |")
        print("|---|---|---|")
        for r in rows:
            print(f"| {r['n']} | {r['idle_keepalive_cpu']:.3f} | {r['idle_heartbeat_cpu']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
