"""Commits a user can read and cannot forget: the training step each commit holds, and one
warning when a job trains long without any commit.

A job that never calls ``state.commit()`` runs fault-free without a sign, and then a failure
sends it back to its beginning; a commit's count ("commit 7") reads as a step but is not one.
So every line that names a commit names the step it holds as well (``position``), and the
session warns once when training has gone ``max_steps`` steps or ``max_seconds`` seconds since
the last commit (``overdue``, a pure function)."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

# The defaults: a job that trains ten minutes or a thousand steps between commits risks that much
# work per failure; ELASTIC_COMMIT_WARN_STEPS / ELASTIC_COMMIT_WARN_SECONDS change them (0: never).
DEFAULT_MAX_STEPS = 1000
DEFAULT_MAX_SECONDS = 600.0


def position(state: Any) -> str:
    """Where training stands in ``state``, as the user counts it: ``step 70``, or ``epoch 3,
    batch 10``; "" when the state has no such counters (then a commit names only its own count)."""
    parts = [f"{name} {getattr(state, name)}" for name in ("step", "epoch", "batch")
             if type(getattr(state, name, None)) is int]
    if parts and parts[0].startswith("step"):
        return parts[0]
    return ", ".join(parts)


def training_step(state: Any) -> int:
    """The state's own step counter (its ``step``), or -1 when it has none: what status and
    metrics show beside a commit's number."""
    step = getattr(state, "step", None)
    return step if type(step) is int and step >= 0 else -1


def describe_commit(commit_step: int, state: Any) -> str:
    """``commit 7 (step 70)``; ``commit -1 (none made yet)`` before the first."""
    if commit_step < 0:
        return "commit -1 (none made yet)"
    where = position(state)
    return f"commit {commit_step} ({where})" if where else f"commit {commit_step}"


def joiner_note_after(form_timeout: float) -> float:
    """Seconds a ring may take to form before a worker says why it waits (a quarter of its form
    timeout, at most 30 s)."""
    return min(30.0, form_timeout / 4)


def joiner_waits(worker_id: str, waited: float, version: int, form_timeout: float) -> str:
    """Why the ring of world ``version`` has not formed for ``worker_id`` after ``waited`` seconds."""
    return (f"worker {worker_id} has waited {waited:.0f} s for the ring of world {version} to form: members "
            f"still in the running world switch at their next state.commit(), which has not come (a job that "
            f"commits rarely or never keeps joiners waiting), or a member does not answer; the form gives up "
            f"after ELASTIC_FORM_TIMEOUT ({form_timeout:g} s)")


def overdue(steps: int, seconds: float, max_steps: int, max_seconds: float) -> Optional[str]:
    """Why a job is overdue for a commit (``steps`` steps and ``seconds`` of training since the
    last one, or since the run began), or None. A limit of 0 is never reached."""
    if max_steps > 0 and steps >= max_steps:
        return f"{steps} training steps"
    if max_seconds > 0 and seconds >= max_seconds:
        return f"{seconds:.0f} s of training" + (f" ({steps} steps)" if steps else "")
    return None


@dataclasses.dataclass
class CommitWatch:
    """Counts the steps and time since the last commit, and warns once per worker when overdue."""

    warn: Callable[[str], None]
    max_steps: int = DEFAULT_MAX_STEPS
    max_seconds: float = DEFAULT_MAX_SECONDS
    clock: Callable[[], float] = time.monotonic
    steps: int = 0               # training steps since the last commit (or the run's start)
    trained: int = 0             # training steps this worker has seen in all
    since: float = dataclasses.field(default=0.0)
    warned: bool = False

    def __post_init__(self) -> None:
        self.since = self.clock()

    def committed(self) -> None:
        self.steps, self.since = 0, self.clock()

    def stepped(self, commit_step: int) -> None:
        """A training step completed (the optimizer stepped); ``commit_step``: the commit held."""
        self.steps += 1
        self.trained += 1
        self.check(commit_step)

    def check(self, commit_step: int) -> None:
        if self.warned:
            return
        why = overdue(self.steps, self.clock() - self.since, self.max_steps, self.max_seconds)
        if why is None:
            return
        self.warned = True
        since = "since the run began, without any state.commit()" if commit_step < 0 else \
            f"since the last state.commit() (commit {commit_step})"
        self.warn(f"{why} {since}: a failure now sends every worker back "
                  f"{'to the beginning' if commit_step < 0 else 'to that commit'}. Call state.commit() every few "
                  f"steps or seconds inside the @elastic.run function (it is cheap: an in-memory copy and one small "
                  f"allreduce); ELASTIC_COMMIT_WARN_STEPS / ELASTIC_COMMIT_WARN_SECONDS set when this warns "
                  f"(0: never)")
