"""How the launcher counts the signals that stop it: a repeat within a second is the same request.

The first SIGINT/SIGTERM/SIGHUP drains the workers (each leaves at its next commit); another one
kills them at once. A wrapper (GNU timeout, some schedulers, a shell that forwards the terminal's
Ctrl-C to a process that got it already) often delivers the same request twice within
milliseconds: counted as two, that would kill every worker where one leave was asked for. So a
repeat that comes within REPEAT_WINDOW_S of the first is an echo of it, and said so in a line.

`record` runs in the signal handler: it only assigns. What to print is read from the main loop.
"""

from __future__ import annotations

from typing import Optional

REPEAT_WINDOW_S = 1.0


class StopSignals:
    def __init__(self) -> None:
        self.first: Optional[int] = None      # the first signal's number
        self.first_at = 0.0
        self.count = 0                        # requests: the first, and each repeat after the window
        self.echo_after: Optional[float] = None   # seconds after the first an echo came (the first echo)
        self._echo_told = False

    def record(self, signum: int, now: float) -> None:
        if self.first is None:
            self.first, self.first_at, self.count = signum, now, 1
        elif now - self.first_at < REPEAT_WINDOW_S:
            if self.echo_after is None:
                self.echo_after = now - self.first_at
        else:
            self.count += 1

    @property
    def hurry(self) -> bool:
        """A second request came: kill at once."""
        return self.count > 1

    def echo_line(self, name: str) -> Optional[str]:
        """Once, after an echo: the line saying it was taken for the first signal."""
        if self.echo_after is None or self._echo_told:
            return None
        self._echo_told = True
        return (f"a second signal {self.echo_after:.3f} s after the {name} was taken for the same request (a wrapper "
                f"such as GNU timeout forwarding it); Ctrl-C again (a second or more after the first) kills the "
                f"workers at once")
