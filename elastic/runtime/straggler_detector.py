"""Straggler detection on the worker: each rank's compute and wait time per commit window,
exchanged on the membership allreduce every commit already runs, and the verdict on it.

In synchronous data parallelism the slowest rank sets everyone's pace, and it is the one that
waits least: the others wait for it inside the collectives. So each rank measures, between two
commit boundaries, how long it was waiting on a collective (the session's ``WaitClock``,
``elastic.ring.wait_clock``: the union, over every thread, of the spans of its blocking
collectives and of its async allreduces from submission to their ``synchronize``, which covers
DDP's comm hook) and how much of the wall time was left: its compute time. An async allreduce
counts from its submission because that is when the rank's own part is in: in DDP the slow rank
submits each bucket last and finds the others waiting, so its buckets complete at once, while
each fast rank waits on every bucket for the slow one. At the boundary each rank puts its two
numbers into its own row of the membership check (``Session.check_membership`` in
elastic/runtime/session.py: one allgather of every rank's row, ``elastic.runtime.boundary``), so
every rank holds every rank's numbers without another round trip, no rank can write another's,
and every rank judges the same numbers alike. Numbers no worker measures (negative, not finite,
more than the window lasted) blame the rank that sent them before any verdict (``boundary.judge``).

A window closes at the first boundary where every rank measured something and the median wall
time reached ``window_s`` (a job that commits every step still judges whole seconds, not
scheduler noise); then ``judge`` (pure, table-tested in tests/elastic/test_stragglers.py):

* a rank is slow in a window when its compute time is above ``factor`` times the world's median
  (the lower middle value for an even size: in a world of two, the slow one is compared with the
  other) and above it by at least ``MIN_EXCESS`` of the window (a job that only communicates is
  not judged on noise);
* it is a straggler once it was slow ``windows`` windows in a row: one slow window (a garbage
  collection, an evaluation on rank 0) names nobody, and a world that is slow everywhere moves
  its median and names nobody either (a rank claiming to compute nothing moves the median only
  down to the fastest honest rank in a world of three or more; in a world of two each rank is
  compared with the other's word: there is no majority to ask);
* its score is its compute time over the median (1: typical), the ``elastic_straggler_score`` metric.

Streaks start again in every world. What a straggler does is the policy (``StragglerConfig``):
``report`` names it (a log line here, the score in the progress report to the rendezvous, which its
launcher and ``elastic-rendezvous status`` show); ``evict`` also makes the worst straggler ask to
leave, as ``elastic.request_leave()`` does, so it leaves at the next commit like a preempted
worker (the others keep their state), unless the world would drop below min-np without a spare
to take its place (``may_leave``). It asks once the rendezvous has its verdict (``told``, after
the progress report that carried it): so it is named before it goes, and the spares it counts on are
the rendezvous' latest word. ``off`` measures nothing and sends zeros, so ranks with different
policies still agree on the allreduce's layout.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import threading
import time
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from rendezvous.wire.membership import StragglerReport


log = logging.getLogger("elastic")

POLICIES = ("off", "report", "evict")
# A slow rank's compute time must exceed the median by this share of the window's wall time: a
# rank that computes 2 ms where the others compute 1 ms of a 1 s window slows nobody down.
MIN_EXCESS = 0.05
SCORE_CAP = 1000.0   # a score when the median compute time is 0 (a world that only communicates)


# ---------------------------------------------------------------------- settings
def _setting(default: Any, env: str, flag: str) -> Any:
    return dataclasses.field(default=default, metadata={"env": env, "flag": flag})


@dataclasses.dataclass(frozen=True)
class StragglerConfig:
    """The straggler settings: defined here once, read from the environment by the worker
    (``WorkerConfig``) and from ``elastic-run``'s flags by the launcher, which passes them on.

    ``policy`` (ELASTIC_STRAGGLER_POLICY, --straggler-policy): "report" (default), "evict" or
    "off". ``factor`` (ELASTIC_STRAGGLER_FACTOR): how many times the world's median compute time
    a rank must take to be slow in a window (default 1.5). ``windows``
    (ELASTIC_STRAGGLER_WINDOWS): slow windows in a row that make it a straggler (default 3).
    ``window_s`` (ELASTIC_STRAGGLER_WINDOW): the shortest window, in seconds of training between
    commits (default 1). A bad value raises ``ValueError`` naming the setting."""

    policy: str = _setting("report", "ELASTIC_STRAGGLER_POLICY", "--straggler-policy")
    factor: float = _setting(1.5, "ELASTIC_STRAGGLER_FACTOR", "--straggler-factor")
    windows: int = _setting(3, "ELASTIC_STRAGGLER_WINDOWS", "--straggler-windows")
    window_s: float = _setting(1.0, "ELASTIC_STRAGGLER_WINDOW", "--straggler-window")

    def __post_init__(self):
        for field in dataclasses.fields(self):
            why = self.problem(field.name, getattr(self, field.name))
            if why is not None:
                raise ValueError(f"{field.name} {getattr(self, field.name)!r}: {why}")

    @staticmethod
    def problem(name: str, value: Any) -> Optional[str]:
        """Why ``value`` cannot be setting ``name`` (None: it can)."""
        return _problem(name, value)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "StragglerConfig":
        """Reads ELASTIC_STRAGGLER_POLICY, _FACTOR, _WINDOWS and _WINDOW (unset or empty: the default)."""
        env = os.environ if env is None else env
        values: Dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            var, raw = field.metadata["env"], env.get(field.metadata["env"], "")
            if raw == "":
                continue
            value = _parse(field, raw.strip())
            why = None if value is None else _problem(field.name, value)
            if value is None or why is not None:
                raise ValueError(f"{var}={raw!r}: {why or f'not a valid {type(field.default).__name__}'}")
            values[field.name] = value
        return cls(**values)

    def to_env(self) -> Dict[str, str]:
        """The variables that give a worker these settings (what ``elastic-run`` passes on)."""
        return {f.metadata["env"]: repr(getattr(self, f.name)) if isinstance(getattr(self, f.name), float)
                else str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @staticmethod
    def flag(name: str) -> str:
        """The ``elastic-run`` flag of setting ``name``."""
        return next(f.metadata["flag"] for f in dataclasses.fields(StragglerConfig) if f.name == name)


def _parse(field: dataclasses.Field, raw: str) -> Any:
    kind = type(field.default)
    if kind is str:
        return raw.lower()
    try:
        return kind(raw)
    except ValueError:
        return None


def _problem(name: str, value: Any) -> Optional[str]:
    """Why ``value`` cannot be setting ``name`` (None: it can)."""
    if name == "policy":
        return None if value in POLICIES else f"use one of {', '.join(POLICIES)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "not a finite number"
    if name == "factor" and not 1.0 < value <= 100.0:
        return "must be above 1 (times the median) and at most 100"
    if name == "windows" and (not isinstance(value, int) or not 1 <= value <= 1000):
        return "must be a whole number of windows from 1 to 1000"
    if name == "window_s" and not 0.0 < value <= 3600.0:
        return "must be in (0, 3600] seconds"
    return None


# ---------------------------------------------------------------------- the verdict (pure)
@dataclasses.dataclass(frozen=True)
class Window:
    """One commit window as every rank measured it, in rank order (seconds)."""

    compute: Tuple[float, ...]   # outside collectives
    wait: Tuple[float, ...]      # inside them


@dataclasses.dataclass(frozen=True)
class Verdict:
    scores: Tuple[float, ...]      # each rank's compute time over the median (1: typical)
    slow: Tuple[int, ...]          # ranks slow in this window
    streaks: Tuple[int, ...]       # each rank's slow windows in a row, this one included
    stragglers: Tuple[int, ...]    # ranks slow for the number of windows that names them

    @property
    def worst(self) -> Optional[int]:
        """The straggler the evict policy acts on: the highest score, the lowest rank among equals."""
        if not self.stragglers:
            return None
        return max(self.stragglers, key=lambda r: (self.scores[r], -r))


def window_closes(compute: Sequence[float], wait: Sequence[float], window_s: float) -> bool:
    """Whether a window ends at this boundary: every rank measured (a rank that sent zeros has
    detection off, or the ring is new), the numbers are sane, and the median wall time is at
    least ``window_s``."""
    walls = [c + w for c, w in zip(compute, wait)]
    if len(walls) < 2 or not all(math.isfinite(x) and x >= 0 for x in (*compute, *wait)):
        return False
    return min(walls) > 0 and statistics.median_low(walls) >= window_s


def judge(streaks: Sequence[int], window: Window, factor: float, windows: int) -> Verdict:
    """The verdict on one closed window, given each rank's streak before it (another length,
    e.g. ``()``: a new world, all zero). The same on every rank, given the same numbers."""
    n = len(window.compute)
    if len(streaks) != n:
        streaks = (0,) * n
    median = statistics.median_low(window.compute)
    wall = statistics.median_low([c + w for c, w in zip(window.compute, window.wait)])
    slow = tuple(r for r, c in enumerate(window.compute)
                 if n >= 2 and c > factor * median and c - median >= MIN_EXCESS * wall)
    scores = tuple(c / median if median > 0 else (1.0 if c == 0 else SCORE_CAP) for c in window.compute)
    scores = tuple(min(s, SCORE_CAP) for s in scores)
    new_streaks = tuple(streaks[r] + 1 if r in slow else 0 for r in range(n))
    return Verdict(scores, slow, new_streaks, tuple(r for r in range(n) if new_streaks[r] >= windows))


def may_leave(size: int, min_np: int, spares: int) -> bool:
    """Whether a straggler may leave a world of ``size``: the job keeps at least ``min_np``
    workers without it, or a spare (registered beyond the world, on another host) takes its place."""
    return size - 1 >= max(min_np, 1) or spares > 0


# ---------------------------------------------------------------------- the worker's detector
class Detector:
    """One worker's detection across the worlds it is in; the session holds it and calls
    ``timings`` and ``window_wall`` before its membership allgather and ``judge`` after it.

    ``leave(why)`` asks this worker to leave (the evict policy); ``room()`` gives the job's
    min-np and the spares the rendezvous last reported, for ``may_leave``. ``now`` and
    ``waited`` are the clocks: wall time, and the seconds spent inside collectives so far;
    ``scored(score)`` is told this worker's score each time a window is judged (its metrics)."""

    def __init__(self, config: StragglerConfig, worker_id: str, *, leave: Callable[[str], None],
                 room: Callable[[], Tuple[int, int]], now: Callable[[], float] = time.perf_counter,
                 waited: Callable[[], float], scored: Callable[[float], None] = lambda score: None):
        self.config, self.worker_id = config, worker_id
        self._leave, self._room = leave, room
        self._now, self._waited_so_far, self._scored = now, waited, scored
        self._comm: Any = None        # the ring whose window is open
        self._opened = 0.0            # perf_counter when it opened
        self._waited = 0.0            # waited() then
        self._streaks: Tuple[int, ...] = ()
        self._asked = False           # this worker asked to leave as a straggler
        self._evict: Optional[Tuple[int, int, str]] = None   # (world version, size, why): it is the one to go
        self._kept_for: Optional[int] = None   # world version in which min-np kept it (logged once)
        self.report: Optional[StragglerReport] = None   # the last verdict on this worker, for the rendezvous

    def timings(self, comm: Any) -> Tuple[float, float]:
        """This rank's compute and wait seconds of the open window, for its row of the membership
        check (zeros when it has none: detection off, or a new ring)."""
        if self.config.policy == "off" or comm is not self._comm:
            return 0.0, 0.0
        wall = self._now() - self._opened
        waited = min(max(self._waited_so_far() - self._waited, 0.0), wall)
        return wall - waited, waited

    def window_wall(self, comm: Any) -> float:
        """How long the open window has lasted here, read after the membership allgather: what
        every rank's timings are checked against. Every rank measured before that allgather
        completed here, in a window opened at the same collective as this one, so none can have
        measured much more. 0 on a new ring, whose first rows are zeros; kept whatever the
        policy, so every rank checks alike."""
        return self._now() - self._opened if comm is self._comm else 0.0

    def judge(self, compute: Sequence[float], wait: Sequence[float], comm: Any) -> Optional[Verdict]:
        """After the membership check (every rank's ``compute`` and ``wait``, in rank order, as
        every rank holds them): the verdict when a window closed (None otherwise), acted on."""
        if comm is not self._comm:   # a new ring: the first window opens now
            self._comm, self._streaks, self._evict = comm, (), None
            self._open()
            return None
        compute, wait = list(compute), list(wait)
        if not window_closes(compute, wait, self.config.window_s):
            return None
        verdict = judge(self._streaks, Window(tuple(compute), tuple(wait)), self.config.factor,
                        self.config.windows)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("commit window of world version %d: compute %s s, wait %s s, scores %s, slow windows %s",
                      comm.world_version, _seconds(compute), _seconds(wait), _seconds(verdict.scores),
                      list(verdict.streaks))
        self._streaks = verdict.streaks
        self._open()
        self._act(verdict, comm)
        return verdict

    def _open(self) -> None:
        self._opened, self._waited = self._now(), self._waited_so_far()

    def _act(self, verdict: Verdict, comm: Any) -> None:
        me = comm.rank
        named = me in verdict.stragglers
        self.report = StragglerReport(comm.world_version, verdict.scores[me], verdict.streaks[me], named)
        self._scored(verdict.scores[me])
        # The one to go, as long as it stays the worst (``told`` carries it out).
        self._evict = (comm.world_version, comm.size, f"a straggler: {verdict.scores[me]:.2f}x the median compute "
                       f"time for {verdict.streaks[me]} windows") if (self.config.policy == "evict"
                                                                      and verdict.worst == me) else None
        if named and verdict.streaks[me] == self.config.windows:
            log.warning("worker %s (rank %d of world version %d) is a straggler: it computed %.2fx the median of "
                        "its world for %d commit window(s) in a row (--straggler-policy %s)", self.worker_id, me,
                        comm.world_version, verdict.scores[me], verdict.streaks[me], self.config.policy)

    def told(self, report: Optional[StragglerReport]) -> None:
        """The rendezvous has ``report`` (its progress report was answered; from the session's event
        thread): a straggler the evict policy picked asks to leave now, if the job keeps min-np."""
        evict = self._evict
        if report is None or not report.named or evict is None or evict[0] != report.world_version or self._asked:
            return
        version, size, why = evict
        min_np, spares = self._room()
        if may_leave(size, min_np, spares):
            self._asked = True
            self._leave(why)
        elif self._kept_for != version:
            self._kept_for = version
            log.warning("worker %s stays although it is a straggler: without it world version %d would have %d "
                        "worker(s), below min-np %d, and no spare is waiting to take its place", self.worker_id,
                        version, size - 1, min_np)


def _seconds(xs: Sequence[float]) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs[:16]) + (", ..." if len(xs) > 16 else "") + "]"
