"""Allreduce latency and bandwidth: elastic-ring's TCP ring against torch.distributed gloo, same run.

    python bench/allreduce.py                      # 2 and 4 ranks, float32, 4 KiB .. 256 MiB
    python bench/allreduce.py --ranks 2 --max-size 64M --iters-scale 0.5

Each rank is a process on this machine; both libraries run in the same processes, size by
size, alternating, so they see the same machine state. Prints per size: median time per
allreduce (rank 0, between barriers), algbw = bytes / time, busbw = algbw * 2(n-1)/n (the
bytes each link must carry, as nccl-tests define it), and our busbw over gloo's.
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


def worker(rank: int, n: int, sizes, scale: float, gloo_port: int, conn) -> None:
    import torch
    import torch.distributed as dist

    import elastic

    torch.set_num_threads(1)
    listener = elastic.Listener("127.0.0.1", 0)
    conn.send(listener.address)
    peers = conn.recv()
    comm = elastic.Communicator.form(listener=listener, job_id="bench", secret=b"bench", world_version=1,
                                     rank=rank, peers=peers, config=elastic.CommConfig(timeout=120))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=n)
    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        iters = iterations(nbytes, scale)
        timings = {"ours": [], "gloo": []}
        for _ in range(2):  # two rounds, alternating libraries, median of the per-round means
            for lib in ("ours", "gloo"):
                run = (lambda: comm.allreduce_(t, elastic.Sum)) if lib == "ours" else (lambda: dist.all_reduce(t))
                run()  # warm-up
                comm.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    run()
                timings[lib].append((time.perf_counter() - start) / iters)
        rows.append((nbytes, statistics.median(timings["ours"]), statistics.median(timings["gloo"])))
    conn.send(rows)
    dist.destroy_process_group()
    comm.close()


def run(n: int, sizes, scale: float):
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe() for _ in range(n)]
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, n, sizes, scale, port, pipes[r][1]), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    try:
        addrs = []
        for r in range(n):
            if not pipes[r][0].poll(60):
                raise RuntimeError(f"rank {r} did not start")
            addrs.append(pipes[r][0].recv())
        for r in range(n):
            pipes[r][0].send(addrs)
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
    args = ap.parse_args(argv)
    lo, hi = parse_size(args.min_size), parse_size(args.max_size)
    if lo < 4 or hi < lo:
        ap.error("need 4 <= --min-size <= --max-size")
    sizes = []
    s = lo
    while s <= hi:
        sizes.append(s)
        s *= 4
    print(f"# allreduce float32 sum, {os.cpu_count()} CPUs, TCP loopback; busbw = algbw * 2(n-1)/n")
    print(f"{'ranks':>5} {'size':>9} | {'ours ms':>9} {'algbw GB/s':>10} {'busbw GB/s':>10} | "
          f"{'gloo ms':>9} {'busbw GB/s':>10} | {'busbw ratio':>11}")
    for n in args.ranks:
        for nbytes, ours, gloo in run(n, sizes, args.iters_scale):
            factor = 2 * (n - 1) / n
            ours_bus, gloo_bus = nbytes / ours / 1e9 * factor, nbytes / gloo / 1e9 * factor
            print(f"{n:>5} {human(nbytes):>9} | {ours * 1e3:>9.3f} {nbytes / ours / 1e9:>10.3f} {ours_bus:>10.3f} | "
                  f"{gloo * 1e3:>9.3f} {gloo_bus:>10.3f} | {ours_bus / gloo_bus:>10.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
