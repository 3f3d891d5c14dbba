"""Async allreduces finished in submission order on one thread, so the caller goes on computing.

DDP's gradient buckets are the user: backward submits each bucket's allreduce and goes on, and
this thread waits for them in order and completes each bucket's future. One per session.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional
Done = Callable[[Optional[BaseException]], None]   # called with None, or the error the wait raised


class Completions:
    """Waits for each handle put here, in order, and calls its ``done`` (see the module doc)."""

    def __init__(self) -> None:
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def put(self, comm: Any, handle: Any, done: Done) -> None:
        """``done(error)`` once ``comm.synchronize(handle)`` returned (error None) or raised."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="elastic-completions", daemon=True)
                self._thread.start()
        self._q.put((comm, handle, done))

    def _loop(self) -> None:
        while True:
            comm, handle, done = self._q.get()
            try:
                comm.synchronize(handle)   # bounded by the ring's collective timeout or an abort
            except Exception as e:  # noqa: BLE001 (done must run, or whoever waits on it waits forever)
                done(e)
            else:
                done(None)
