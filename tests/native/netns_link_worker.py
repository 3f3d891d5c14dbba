"""One rank of the dead-link test, run as
`ip netns exec NS python netns_link_worker.py RANK LISTEN PEERS DEAD_LINK_TIMEOUT`.

Forms a ring with a collective timeout of 600 s and the given dead-link timeout, prints "running",
then allreduces 4 MiB until
that fails; prints one JSON line: the error's reason and text, and when it failed (monotonic).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import elastic


def main() -> None:
    rank, listen, peers, dead_link = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), float(sys.argv[4])
    host, port = listen.rsplit(":", 1)
    listener = elastic.Listener(host, int(port))
    comm = elastic.Communicator.form(listener=listener, job_id="netns", secret=b"netns-secret", world_version=1,
                                     rank=rank, peers=peers, config=elastic.CommConfig(timeout=600, form_timeout=30,
                                                                               dead_link_timeout=dead_link))
    buf = np.ones(1 << 20, dtype=np.float32)
    comm.allreduce_(buf, elastic.Sum)
    print("running", flush=True)
    try:
        while True:
            comm.allreduce_(buf, elastic.Sum)
    except elastic.WorkerLostError as e:
        print(json.dumps({"rank": rank, "reason": e.reason, "text": str(e), "at": time.monotonic()}), flush=True)
    comm.close()
    listener.close()


if __name__ == "__main__":
    main()
