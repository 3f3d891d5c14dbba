"""Scale benchmark of the rendezvous service: N lightweight workers join one job on the etcd-backed server.

For each N it prints: time from the last join until every worker holds the same world; time from
killing 10% of the workers (their connections drop, as on a crash) until every survivor holds the next
world; the server's CPU time and peak memory (it runs as its own process against a local etcd).
With --liveness it also compares the server's CPU cost of keeping N idle workers alive with HTTP/2
keepalive only (the design) against a unary RPC per worker per second, as Python heartbeats would
be (the alternative; ReportProgress stands in for one).

    python bench/rendezvous_scale.py                    # N = 64, 256, 1024
    python bench/rendezvous_scale.py --sizes 64,128 --liveness

Workers are grpc.aio clients in this process, each with its own channel (its own TCP connection, as
separate processes would have). Targets at N = 1024: <= 3 s and <= 2 s. Only our server runs
here: no peer.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import grpc  # noqa: E402
from grpc import aio  # noqa: E402

from rendezvous.wire.messages import pb, pb_grpc  # noqa: E402
from rendezvous.common.channel import channel_options  # noqa: E402
from rendezvous.server.etcd_process import EtcdProcess  # noqa: E402

TIMEOUT_S = 120.0


class Server:
    """`python -m rendezvous serve` against etcd, in its own process so its CPU/memory are its own."""

    def __init__(self, tmp: str, etcd: str, prefix: str):
        port_file = os.path.join(tmp, f"port-{prefix.strip('/')}")
        env = dict(os.environ, PYTHONPATH=REPO)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rendezvous", "serve", "--host", "127.0.0.1", "--port", "0",
             "--port-file", port_file, "--etcd", etcd, "--etcd-prefix", prefix, "--insecure",
             "--log-level", os.environ.get("BENCH_SERVER_LOG", "WARNING")], cwd=REPO, env=env)
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
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class Worker:
    def __init__(self, address: str, job: str, i: int, n: int):
        self.i = i
        # The same options as a RendezvousClient: its keepalive pings are part of the server's load.
        self.channel = aio.insecure_channel(address, options=channel_options())
        self.stub = pb_grpc.RendezvousStub(self.channel)
        self.job, self.n = job, n
        self.worlds: dict[int, tuple[float, int]] = {}   # version -> (time received, size)
        self.changed = asyncio.Event()
        self.task = None
        self.session = ""

    async def join(self) -> float:
        resp = await self.stub.Join(pb.JoinRequest(
            job_id=self.job, worker_id=f"w{self.i:05d}", host=f"host{self.i // 8}",
            ring_address=f"127.0.0.1:{10000 + self.i}", commit_step=-1,
            spec=pb.JobSpec(min_np=1, max_np=self.n)), timeout=TIMEOUT_S)
        self.session = resp.session_id
        self.task = asyncio.get_running_loop().create_task(self._watch())
        return time.monotonic()

    async def _watch(self) -> None:
        try:
            async for ev in self.stub.Watch(pb.WatchRequest(session_id=self.session)):
                if ev.WhichOneof("event") == "world":
                    self.worlds[ev.world.world_version] = (time.monotonic(), ev.world.size)
                    self.changed.set()
        except (grpc.RpcError, asyncio.CancelledError):
            pass

    async def until_world(self, size: int, deadline: float) -> tuple[int, float]:
        """(version, time received) of the first world of `size` members."""
        while True:
            for v, (t, s) in sorted(self.worlds.items()):
                if s == size:
                    return v, t
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), max(0.01, deadline - time.monotonic()))

    async def crash(self) -> None:
        """Drop the connection without leaving, as a killed process would."""
        await self.channel.close(grace=None)

    async def heartbeat_forever(self, period_s: float) -> None:
        while True:
            # What a Python heartbeat would cost the server: one unary RPC of this session.
            await self.stub.ReportProgress(pb.ReportProgressRequest(session_id=self.session,
                                                                    commit_step=-1), timeout=TIMEOUT_S)
            await asyncio.sleep(period_s)


async def run_size(server: Server, n: int, liveness: bool) -> dict:
    job = f"bench-{n}"
    workers = [Worker(server.address, job, i, n) for i in range(n)]
    cpu0 = server.cpu_s()
    sem = asyncio.Semaphore(128)  # bound in-flight joins, like a launcher ramping up

    async def join(w):
        async with sem:
            return await w.join()
    join_times = await asyncio.gather(*(join(w) for w in workers))
    last_join = max(join_times)
    deadline = time.monotonic() + TIMEOUT_S
    got = await asyncio.gather(*(w.until_world(n, deadline) for w in workers))
    versions = {v for v, _ in got}
    assert len(versions) == 1, f"workers disagree on the full world: {versions}"
    form_s = max(t for _, t in got) - last_join
    cpu_join = server.cpu_s() - cpu0

    result = {"n": n, "form_s": form_s, "cpu_join_s": cpu_join}
    if liveness:
        result.update(await idle_cost(server, workers))

    victims = workers[: max(1, n // 10)]
    survivors = workers[len(victims):]
    cpu1 = server.cpu_s()
    killed_at = time.monotonic()
    await asyncio.gather(*(v.crash() for v in victims))
    deadline = time.monotonic() + TIMEOUT_S
    got = await asyncio.gather(*(w.until_world(len(survivors), deadline) for w in survivors))
    assert len({v for v, _ in got}) == 1, "survivors disagree on the next world"
    result["recover_s"] = max(t for _, t in got) - killed_at
    result["cpu_recover_s"] = server.cpu_s() - cpu1
    for w in survivors:
        w.task.cancel()
        await w.channel.close(grace=None)
    return result


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,256,1024", help="comma-separated N (default: %(default)s)")
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
                server = Server(tmp, etcd.endpoint, f"/bench-{n}-{os.getpid()}")
                try:
                    r = asyncio.run(run_size(server, n, a.liveness))
                    r["peak_mib"] = server.peak_rss_mib()
                    r["cpu_total_s"] = server.cpu_s()
                finally:
                    server.stop()
                rows.append(r)
                print(f"N={n}: done", file=sys.stderr, flush=True)
        finally:
            etcd.stop()
    head = ("| N | last join → same world (s) | kill 10% → next world (s) | server CPU: joins (s) |"
            " server CPU: recovery (s) | server CPU total (s) | server peak RSS (MiB) |")
    print(head)
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['form_s']:.2f} | {r['recover_s']:.2f} | {r['cpu_join_s']:.2f} | "
              f"{r['cpu_recover_s']:.2f} | {r['cpu_total_s']:.2f} | {r['peak_mib']:.0f} |")
    if a.liveness:
        print()
        print("| N | idle server CPU, keepalive only (cores) | idle server CPU, 1 Hz heartbeats (cores) |")
        print("|---|---|---|")
        for r in rows:
            print(f"| {r['n']} | {r['idle_keepalive_cpu']:.3f} | {r['idle_heartbeat_cpu']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
