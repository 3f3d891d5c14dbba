"""How long a rank waited on collectives: the clock straggler detection reads its compute time from.

Each ``Communicator`` is given the ``WaitClock`` of its session (one per worker process, so the
worlds of one session count into one clock); the time a caller spends blocked in a collective, or
an async allreduce from submission to its ``synchronize``, is a span of it. A rank's compute time
between two commits is the wall time minus the spans (``elastic.runtime.straggler_detector``).
"""

from __future__ import annotations

import threading
import time


class WaitClock:
    """Seconds spent waiting on collectives: the union of the spans every thread reports (DDP's
    completion thread waits while the training thread computes; two threads waiting at once
    count once)."""

    __slots__ = ("seconds", "_until", "_lock")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._until = 0.0    # end of the latest span counted
        self._lock = threading.Lock()

    def waited(self, started: float) -> None:
        """A span from ``started`` (``time.perf_counter()``) to now; the part already counted is not
        counted again (spans are reported as they end, so this is their union)."""
        now = time.perf_counter()
        with self._lock:
            self.seconds += max(0.0, now - max(started, self._until))
            if now > self._until:
                self._until = now
