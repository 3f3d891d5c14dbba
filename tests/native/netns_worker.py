"""One rank of the network-namespace test, run as `ip netns exec NS python netns_worker.py ...`.

Prints one JSON line: this rank's link kinds and the digests of its allreduce results.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

import elastic


def main() -> None:
    rank, listen, peers, hosts = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), sys.argv[4].split(",")
    host, port = listen.rsplit(":", 1)
    listener = elastic.Listener(host, int(port))
    comm = elastic.Communicator.form(listener=listener, job_id="netns", secret=b"netns-secret", world_version=1,
                                     rank=rank, peers=peers, hosts=hosts,
                                     config=elastic.CommConfig(timeout=30, form_timeout=30))
    digests, ok = {}, True
    for dtype in ["float32", "float64", "int32", "uint8"]:
        for count in [1, 1001, 3_000_017]:  # small path, ring, many segments
            rng = np.random.default_rng([rank, count])
            t = rng.integers(0, 50, count).astype(dtype)
            comm.allreduce_(t, elastic.Sum)
            want = sum(np.random.default_rng([r, count]).integers(0, 50, count).astype(dtype)
                       for r in range(comm.size)).astype(dtype)
            ok &= bool(np.array_equal(t, want))
            digests[f"{dtype}/{count}"] = hashlib.sha256(t.tobytes()).hexdigest()
    print(json.dumps({"rank": rank, "links": list(comm.link_kinds), "ok": ok, "digests": digests}), flush=True)
    comm.close()
    listener.close()


if __name__ == "__main__":
    main()
