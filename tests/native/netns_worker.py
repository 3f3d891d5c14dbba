"""One rank of the network-namespace test, run as `ip netns exec NS python netns_worker.py ...`.

Prints one JSON line: this rank's link kinds and the digests of its allreduce results.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np
import torch

import elastic


def main() -> None:
    rank, listen, peers, hosts = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), sys.argv[4].split(",")
    algorithm = sys.argv[5] if len(sys.argv) > 5 else "auto"
    host, port = listen.rsplit(":", 1)
    listener = elastic.Listener(host, int(port))
    comm = elastic.Communicator.form(listener=listener, job_id="netns", secret=b"netns-secret", world_version=1,
                                     rank=rank, peers=peers, hosts=hosts,
                                     config=elastic.CommConfig(timeout=30, form_timeout=30, algorithm=algorithm))
    digests, ok, used = {}, True, set()
    counts = [1, 1001, 3_000_017]  # small path, ring, many segments
    # Every rank's inputs, and their sum and maximum, once per count (not once per dtype and op).
    mine, sums, maxima = {}, {}, {}
    for count in counts:
        inputs = [np.random.default_rng([r, count]).integers(0, 50, count) for r in range(comm.size)]
        mine[count], sums[count], maxima[count] = inputs[rank], sum(inputs), np.max(inputs, axis=0)
    for dtype in ["float32", "float64", "int32", "uint8", "float16", "bfloat16"]:
        for op in [elastic.Sum, elastic.Average, elastic.Max]:
            for count in counts:
                vals = mine[count]
                want = maxima[count] if op == elastic.Max else sums[count]
                if dtype in ("float16", "bfloat16"):
                    t = torch.from_numpy(vals.astype(np.float32)).to(getattr(torch, dtype))
                else:
                    t = vals.astype(dtype)
                used.add(comm.algorithm_for(count * t.itemsize if isinstance(t, np.ndarray) else count * 2))
                comm.allreduce_(t, op)
                if op == elastic.Average:
                    want = (want // comm.size) if dtype in ("int32", "uint8") else want.astype(np.float32) / comm.size
                got = t.to(torch.float32).numpy() if not isinstance(t, np.ndarray) else t
                ok &= bool(np.array_equal(got, np.asarray(want).astype(got.dtype)))
                raw = t.view(torch.int16).numpy() if not isinstance(t, np.ndarray) else t
                digests[f"{dtype}/{op.name}/{count}"] = hashlib.sha256(raw.tobytes()).hexdigest()
    print(json.dumps({"rank": rank, "links": list(comm.link_kinds), "ok": ok, "digests": digests,
                      "hierarchical_links": [list(k) for k in comm.hierarchical_link_kinds],
                      "algorithms": sorted(used)}), flush=True)
    comm.close()
    listener.close()


if __name__ == "__main__":
    main()
