"""How the leader's event loop spent a 16,384-worker re-form: per Watch stream, or once per change.

Reads what `BENCH_PYSPY=<folder> python bench/rendezvous_scale.py --sizes 16384` leaves in
<folder>/reform-server.txt (py-spy's collapsed stacks of the server, sampled at 200 Hz from the
kill until every survivor held the next world) and sorts each sample of the event loop's thread:

- per stream: queueing a notice or view on each stream, and in each Watch handler building and
  writing it (a design with one stream per host, carrying its 8 workers, would do this 8 times
  less often; its messages would be 8 times larger);
- decision and journal: deciding the events (a broken stream's eviction included) and writing
  the job to etcd (the same whatever carries the streams);
- loop and gRPC, other: the event loop and gRPC's callbacks outside our handlers.

py-spy samples a thread whenever it is not idle, on a core or waiting for one, so the shares are
of the loop's busy wall time, not CPU seconds. Usage:

    python bench/rendezvous_stream_share.py <folder>/reform-server.txt
"""
from __future__ import annotations

import collections
import sys

RATE_HZ = 200   # bench/rendezvous_scale.py's py-spy rate


def kind(stack: str) -> str:
    if (("RendezvousService.Watch" in stack and "RendezvousService.evict" not in stack)
            or "RendezvousService.send" in stack):
        return "per stream: views and notices queued and written"
    if "Journal." in stack or "decide" in stack or "RendezvousService.evict" in stack:
        return "decision and journal"
    return "loop and gRPC, other"


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    shares: collections.Counter = collections.Counter()
    with open(sys.argv[1]) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack or not count.isdigit():
                continue
            if "BaseEventLoop.run_forever" in stack:   # the event loop's thread only
                shares[kind(stack)] += int(count)
    total = sum(shares.values())
    if not total:
        print(f"no samples of the event loop in {sys.argv[1]}", file=sys.stderr)
        return 1
    print("| the event loop's busy time in the re-form | s | share |")
    print("|---|---|---|")
    for what, n in shares.most_common():
        print(f"| {what} | {n / RATE_HZ:.2f} | {100 * n / total:.0f}% |")
    print(f"| all | {total / RATE_HZ:.2f} | 100% |")
    per_stream = shares["per stream: views and notices queued and written"]
    print(f"\none stream per host of 8 workers: {(total - per_stream * 7 / 8) / RATE_HZ:.2f} s "
          f"({100 * (1 - per_stream * 7 / 8 / total):.0f}% of now), if the per-stream part shrinks 8x "
          f"and nothing else changes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
