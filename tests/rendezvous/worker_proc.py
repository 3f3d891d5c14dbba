"""A worker process for the integration tests: joins a job and prints every event as a JSON line.

    python worker_proc.py ADDR[,ADDR] JOB WORKER_ID HOST MIN_NP MAX_NP [--hold-gil-after-world S]

With --hold-gil-after-world, after the first world it makes one C call that holds the GIL for S seconds
(what training code does in a big op), then prints {"event": "released"}.
"""
import ctypes
import json
import sys
import time

from rendezvous.wire.membership import JobSpec
from rendezvous.client.watch_events import Abort, Ended, Finished, Pending, Standby, WorldInfo
from rendezvous.client.worker_client import RendezvousClient


def emit(**kw):
    print(json.dumps({"t": time.time(), **kw}), flush=True)


def hold_gil(seconds: float) -> None:
    # libc's usleep called through ctypes.PyDLL, which (unlike CDLL) keeps the GIL for the whole
    # call: what a long C/C++ op in training code does, for an exact duration.
    usleep = ctypes.PyDLL(None).usleep
    usleep.argtypes = [ctypes.c_uint]
    emit(event="holding")
    usleep(int(seconds * 1e6))


def main():
    addresses, job, worker, host, min_np, max_np = sys.argv[1:7]
    hold = float(sys.argv[8]) if len(sys.argv) > 8 and sys.argv[7] == "--hold-gil-after-world" else 0
    client = RendezvousClient(addresses.split(","), job_id=job, worker_id=worker, host=host,
                              ring_address=f"127.0.0.1:{30000 + abs(hash(worker)) % 20000}",
                              spec=JobSpec(int(min_np), int(max_np)), reconnect_timeout_s=60)
    client.join()
    emit(event="joined", session=client.session_id)
    held = False
    while True:
        ev = client.next_event(60.0)
        if isinstance(ev, WorldInfo):
            emit(event="world", version=ev.world_version, rank=ev.rank, size=ev.size,
                 members=[m.worker_id for m in ev.peers])
            if hold and not held:
                held = True
                hold_gil(hold)
                emit(event="released")
        elif isinstance(ev, Abort):
            emit(event="abort", version=ev.world_version, reason=ev.reason)
        elif isinstance(ev, Pending):
            emit(event="pending", version=ev.world_version)
        elif isinstance(ev, Standby):
            emit(event="standby", version=ev.world_version)
        elif isinstance(ev, (Finished, Ended)):
            emit(event=type(ev).__name__.lower(), reason=ev.reason)
            return


if __name__ == "__main__":
    main()
