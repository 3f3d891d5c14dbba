"""The process's one session: the only process-wide state of the worker runtime.

Everything that asks "which world am I in, and on which ring" (``elastic.rank()``, the
collectives, torch.distributed's default group, a State's commit) asks the session installed
here. ``elastic.init()`` installs a ``JobSession``, joined to a job; a ring formed by hand (tools,
tests) installs a plain ``Session`` on that ring (``elastic.runtime.world.use_ring``). A session
that ended stays installed: its last world answers ``rank()`` and ``size()``, and the ring it
kept for collectives after ``elastic.run`` returned is its to close, until another replaces it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from elastic.runtime.session import Session

_lock = threading.Lock()
_session: "Optional[Session]" = None


def session() -> "Optional[Session]":
    """The process's session (running, or ended and still answering), or None before any."""
    return _session


def install(new: "Optional[Session]") -> "Optional[Session]":
    """Makes ``new`` the process's session and returns the one it replaced (the caller closes
    what that one kept)."""
    global _session
    with _lock:
        old, _session = _session, new
    return old


def install_if(expected: "Optional[Session]", new: "Optional[Session]") -> bool:
    """``install(new)`` only while ``expected`` is the process's session; whether it did."""
    global _session
    with _lock:
        if _session is not expected:
            return False
        _session = new
    return True
