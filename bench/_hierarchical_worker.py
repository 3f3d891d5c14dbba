"""One rank of bench/hierarchical.py, run as `ip netns exec NS python _hierarchical_worker.py GLOBAL_RANK ADDR`.

Talks JSON lines with the driver: prints its three listener addresses, reads every rank's
addresses, forms the flat, local and cross communicators, then runs "run" commands (all
schedules, sizes and iterations) and prints one JSON line of results per command.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

import elastic



def send(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def recv():
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)  # the driver went away
    return json.loads(line)


def pattern(count: int, rank: int) -> np.ndarray:
    # Integer values 0..50: every sum of 4 ranks is exact in float32, whatever the order.
    return ((np.arange(count, dtype=np.int64) * 7 + rank * 13) % 51).astype(np.float32)


def main() -> None:
    g, addr = int(sys.argv[1]), sys.argv[2]
    pin = sys.argv[3] if len(sys.argv) > 3 else ""
    if pin:
        os.sched_setaffinity(0, {int(c) for c in pin.split(",")})
    host, local = g // 2, g % 2            # global ranks: a0 a1 b0 b1
    listeners = {k: elastic.Listener(addr, 0) for k in ("flat", "local", "cross", "native")}
    send({"addrs": {k: l.address for k, l in listeners.items()}})
    peers = recv()["addrs"]                # list indexed by global rank, each {flat, local, cross}
    # The composed schedules run on plain rings; "native" is the core's hierarchical allreduce.
    cfg = elastic.CommConfig(timeout=120, form_timeout=60, algorithm="ring")
    secret = b"hierarchical-bench"
    flat = elastic.Communicator.form(listener=listeners["flat"], job_id="flat", secret=secret, world_version=1,
                                     rank=g, peers=[p["flat"] for p in peers], config=cfg,
                                     hosts=["a", "a", "b", "b"])
    native = elastic.Communicator.form(listener=listeners["native"], job_id="native", secret=secret,
                                       world_version=1, rank=g, peers=[p["native"] for p in peers],
                                       config=elastic.CommConfig(timeout=120, form_timeout=60,
                                                                 algorithm="hierarchical"),
                                       hosts=["a", "a", "b", "b"])
    hname = "ab"[host]
    loc = elastic.Communicator.form(listener=listeners["local"], job_id=f"local-{hname}", secret=secret,
                                    world_version=1, rank=local,
                                    peers=[peers[2 * host + i]["local"] for i in range(2)], config=cfg,
                                    hosts=[hname, hname])
    cross = elastic.Communicator.form(listener=listeners["cross"], job_id=f"cross-{local}", secret=secret,
                                      world_version=1, rank=host,
                                      peers=[peers[2 * h + local]["cross"] for h in range(2)], config=cfg,
                                      hosts=["a", "b"])
    send({"links": {"flat": list(flat.link_kinds), "local": list(loc.link_kinds), "cross": list(cross.link_kinds),
                    "native": [list(k) for k in native.hierarchical_link_kinds]}})

    Sum = elastic.Sum
    while True:
        cmd = recv()
        if cmd.get("cmd") != "run":
            break
        out = {}
        for nbytes in cmd["sizes"]:
            count = nbytes // 4
            half = count // 2
            hb = half * 4
            inp = pattern(count, g)
            ref = sum(pattern(count, r).astype(np.int64) for r in range(4)).astype(np.float32)
            buf = np.zeros(count, dtype=np.float32)
            scratch = np.zeros(count, dtype=np.float32)   # pages faulted in before timing
            mine = slice(local * half, (local + 1) * half)
            other = slice((1 - local) * half, (2 - local) * half)
            peer_block = other  # the peer (local rank 1-local) contributes block 1-local: that offset

            def run(sched: str) -> list:
                """Runs one schedule; returns the perf_counter times at the end of each phase."""
                marks = []
                if sched == "flat":
                    flat.allreduce_(buf, Sum)
                elif sched == "native":
                    native.allreduce_(buf, Sum)
                elif sched == "h_rs":
                    # local reduce-scatter, emulated: an allgather in which each rank contributes
                    # the half its peer owns, then this rank adds the peer's copy of its own half
                    loc._native.allgather_(buf[other], scratch, [hb, hb])
                    np.add(buf[mine], scratch[peer_block], out=buf[mine])
                    marks.append(time.perf_counter())
                    cross.allreduce_(buf[mine], Sum)            # both local ranks cross in parallel
                    marks.append(time.perf_counter())
                    loc._native.allgather_(buf[mine], buf, [hb, hb])  # in place: own block already there
                elif sched == "h_ar":
                    loc.allreduce_(buf, Sum)                    # local allreduce of the whole buffer
                    marks.append(time.perf_counter())
                    cross.allreduce_(buf[mine], Sum)            # then each local rank crosses its half
                    marks.append(time.perf_counter())
                    loc._native.allgather_(buf[mine], buf, [hb, hb])
                elif sched == "h_lead":
                    loc.allreduce_(buf, Sum)
                    marks.append(time.perf_counter())
                    if local == 0:
                        cross.allreduce_(buf, Sum)              # leaders only, whole buffer
                    marks.append(time.perf_counter())
                    loc.broadcast_(buf, 0)
                else:
                    raise ValueError(sched)
                marks.append(time.perf_counter())
                return marks

            times = {s: [] for s in cmd["schedules"]}
            phases = {s: [] for s in cmd["schedules"]}   # per iteration: start and end of each phase (perf_counter)
            ok = {s: True for s in cmd["schedules"]}
            digest = {}
            for it in range(cmd["warmup"] + cmd["iters"]):
                for s in cmd["schedules"]:
                    np.copyto(buf, inp)
                    flat.barrier()
                    t0 = time.perf_counter()
                    marks = run(s)
                    t1 = time.perf_counter()
                    if it >= cmd["warmup"]:
                        times[s].append(t1 - t0)
                        phases[s].append([t0] + marks)   # CLOCK_MONOTONIC: one clock for all ranks
                    ok[s] &= bool(np.array_equal(buf.view(np.uint32), ref.view(np.uint32)))
                    digest[s] = hashlib.sha256(buf.tobytes()).hexdigest()[:16]
            out[str(nbytes)] = {"times": times, "phases": phases, "ok": ok, "digest": digest,
                                "ref": hashlib.sha256(ref.tobytes()).hexdigest()[:16]}
        send({"results": out})
    for c in (native, cross, loc, flat):
        c.close()
    for l in listeners.values():
        l.close()


if __name__ == "__main__":
    main()
