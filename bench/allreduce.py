"""Allreduce latency and bandwidth: elastic-ring over TCP and over shared memory against
torch.distributed gloo, all in the same run.

    python bench/allreduce.py                      # 2 and 4 ranks, float32, 4 KiB .. 256 MiB
    python bench/allreduce.py --ranks 2 --max-size 64M --iters-scale 0.5
    python bench/allreduce.py --transports shm     # only our shared-memory path against gloo

Each rank is a process on this machine; every library runs in the same processes, size by
size, alternating, so they see the same machine state. "tcp" is our ring with every link
over TCP loopback (no host names given); "shm" is the same ring told that every rank is on
one host, so ring neighbours exchange data through shared memory. Prints per size and
library: median time per allreduce (rank 0, between barriers), busbw = algbw * 2(n-1)/n
(algbw = bytes / time; busbw is what each link must carry, as nccl-tests define it), and
our busbw over gloo's. The header line gives this machine's single-core memcpy bandwidth
at 64 MiB, the ceiling the shared-memory path is measured against.

The peer, torch.distributed's gloo, runs as torch documents it for CPU tensors (docs.pytorch.org,
distributed.html, "Which backend to use?": gloo for CPU): init_process_group("gloo") with its
defaults and dist.all_reduce(t) (SUM) on a contiguous float32 tensor. gloo has no setting for an
allreduce on one host beyond the interface it binds (GLOO_SOCKET_IFNAME; loopback here).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

import numpy as np


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("IB")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def human(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return f"{n} B"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def iterations(nbytes: int, scale: float) -> int:
    # About 0.5 s of work per size and library at ~1 GB/s, never fewer than 3 timed runs.
    return max(3, int(min(300, (512 << 20) / max(nbytes, 1) / 16) * scale))


def worker(rank: int, n: int, sizes, scale: float, transports, gloo_port: int, conn) -> None:
    import torch
    import torch.distributed as dist

    import elastic

    torch.set_num_threads(1)
    listeners = {tr: elastic.Listener("127.0.0.1", 0) for tr in transports}
    conn.send({tr: l.address for tr, l in listeners.items()})
    peers = conn.recv()
    comms = {}
    for tr in transports:
        comms[tr] = elastic.Communicator.form(listener=listeners[tr], job_id="bench", secret=b"bench",
                                              world_version=1, rank=rank, peers=peers[tr],
                                              hosts=["this-host"] * n if tr == "shm" else None,
                                              config=elastic.CommConfig(timeout=120))
        assert comms[tr].link_kinds == (tr, tr), comms[tr].link_kinds
    barrier = comms[transports[0]].barrier
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=n)
    rows = []
    libs = list(transports) + ["gloo"]
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        iters = iterations(nbytes, scale)
        timings = {lib: [] for lib in libs}
        for _ in range(2):  # two rounds, alternating libraries, median of the per-round means
            for lib in libs:
                if lib == "gloo":
                    run = lambda: dist.all_reduce(t)  # noqa: E731
                else:
                    run = lambda c=comms[lib]: c.allreduce_(t, elastic.Sum)  # noqa: E731
                run()  # warm-up
                barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    run()
                timings[lib].append((time.perf_counter() - start) / iters)
        rows.append((nbytes, {lib: statistics.median(v) for lib, v in timings.items()}))
    conn.send(rows)
    dist.destroy_process_group()
    for c in comms.values():
        c.close()


def memcpy_gbps(nbytes: int = 64 << 20) -> float:
    """Single-core memcpy bandwidth (bytes copied per second), median of a few."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    times = []
    for _ in range(9):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def run(n: int, sizes, scale: float, transports):
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe() for _ in range(n)]
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, n, sizes, scale, transports, port, pipes[r][1]), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    try:
        addrs = []
        for r in range(n):
            if not pipes[r][0].poll(60):
                raise RuntimeError(f"rank {r} did not start")
            addrs.append(pipes[r][0].recv())
        peers = {tr: [a[tr] for a in addrs] for tr in transports}
        for r in range(n):
            pipes[r][0].send(peers)
        if not pipes[0][0].poll(3600):
            raise RuntimeError("benchmark did not finish within an hour")
        return pipes[0][0].recv()
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes to measure (default: 2 4)")
    ap.add_argument("--min-size", default="4K", help="smallest buffer (default 4K)")
    ap.add_argument("--max-size", default="256M", help="largest buffer (default 256M)")
    ap.add_argument("--iters-scale", type=float, default=1.0, help="multiply the iteration counts (default 1)")
    ap.add_argument("--transports", nargs="+", default=["tcp", "shm"], choices=["tcp", "shm"],
                    help="our transports to measure (default: tcp shm)")
    args = ap.parse_args(argv)
    lo, hi = parse_size(args.min_size), parse_size(args.max_size)
    if lo < 4 or hi < lo:
        ap.error("need 4 <= --min-size <= --max-size")
    sizes = []
    s = lo
    while s <= hi:
        sizes.append(s)
        s *= 4
    transports = list(dict.fromkeys(args.transports))
    print(f"# allreduce float32 sum, {os.cpu_count()} CPUs; busbw = algbw * 2(n-1)/n in GB/s; "
          f"ratio = our busbw / gloo's; memcpy (1 core, 64 MiB) {memcpy_gbps():.2f} GB/s")
    head = f"{'ranks':>5} {'size':>9} |"
    for tr in transports:
        head += f" {tr + ' ms':>9} {'busbw':>7} {'ratio':>7} |"
    head += f" {'gloo ms':>9} {'busbw':>7}"
    print(head)
    for n in args.ranks:
        factor = 2 * (n - 1) / n
        for nbytes, times in run(n, sizes, args.iters_scale, transports):
            gloo_bus = nbytes / times["gloo"] / 1e9 * factor
            line = f"{n:>5} {human(nbytes):>9} |"
            for tr in transports:
                bus = nbytes / times[tr] / 1e9 * factor
                line += f" {times[tr] * 1e3:>9.3f} {bus:>7.3f} {bus / gloo_bus:>6.2f}x |"
            line += f" {times['gloo'] * 1e3:>9.3f} {gloo_bus:>7.3f}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
