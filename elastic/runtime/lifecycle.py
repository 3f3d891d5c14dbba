"""``elastic.init()``, ``elastic.shutdown()`` and ``elastic.request_leave()``: the process's job session."""

from __future__ import annotations

import logging
from typing import Optional, Union

from elastic.runtime import current, logs
from elastic.runtime.errors import RendezvousError
from elastic.runtime.job_session import Ending, JobSession
from elastic.runtime.preemption import LeaveCause
from elastic.runtime.session import Session
from elastic.runtime.worker_config import WorkerConfig

log = logging.getLogger("elastic")


def init(config: Optional[WorkerConfig] = None, *, form: bool = True) -> JobSession:
    """Joins the job and (unless ``form=False``) forms the ring of the first world that
    includes this worker.

    Idempotent: later calls return the same session. Reads the environment the launcher
    sets (see ``elastic.runtime.worker_config``) unless ``config`` is given. ``elastic.run``
    joins through ``init_for_run`` and forms inside its recovery loop, so a failure while the
    first ring forms is handled like any other.
    """
    s = _joined(config, leave_signals=False)
    if form and s.world is None:
        s.form(s.next_world(1))
        log.info("worker %s is rank %d of %d in world version %d", s.config.worker_id, s.world.rank,
                 s.world.size, s.world.world_version)
    return s


def init_for_run() -> JobSession:
    """The session ``elastic.run`` runs in: joined, its ring formed in the run's loop, and
    SIGTERM/SIGINT a leave request from before the join on (``JobSession.catch_leave_signals``)."""
    return _joined(None, leave_signals=True)


def running() -> Optional[JobSession]:
    """The process's job session while it runs (joined and not ended), else None."""
    s = current.session()
    return s if isinstance(s, JobSession) and not s.ended else None


def _joined(config: Optional[WorkerConfig], leave_signals: bool) -> JobSession:
    s = running()
    if s is not None:
        return s
    config = config or WorkerConfig.from_env()
    logs.install(config.log_level)   # before the first line (standby) is logged
    s = JobSession(config)
    if leave_signals:
        s.catch_leave_signals()
    try:
        s.start()
    except BaseException:
        s.release_leave_signals()
        raise
    replaced = current.install(s)
    if replaced is not None:
        replaced.close_ring()   # the ring the last run kept for collectives after it
    return s


def shutdown(success: Union[Ending, bool, None] = True) -> None:
    """Ends this worker's session: ``True`` (``Ending.SUCCEEDED``) reports success, ``False``
    (``Ending.LEFT``) leaves, ``None`` (``Ending.CLOSED``) just closes.

    Its last world stays readable (``rank()``, ``size()`` …); collectives raise from here on."""
    ending = success if isinstance(success, Ending) else \
        {True: Ending.SUCCEEDED, False: Ending.LEFT, None: Ending.CLOSED}[success]
    s = current.session()
    if s is None:
        return
    if not isinstance(s, JobSession):
        return   # a ring installed by hand is its owner's to close
    if not s.ended:
        s.finish(ending, keep_ring=False)
    else:
        s.close_ring()   # the ring kept for collectives after the run


def request_leave(reason: str = "elastic.request_leave()") -> None:
    """Asks this worker to leave the job gracefully at its next commit boundary, as SIGTERM does
    under ``elastic.run``: for platforms that announce preemption another way (a metadata
    endpoint, a notice file). Safe from any thread; later calls change nothing. The grace
    (``ELASTIC_PREEMPT_GRACE``) runs from the first call. ``reason`` goes to the log lines.
    ``elastic.run`` then raises ``elastic.LeaveRequested``."""
    s = running()
    if s is None:
        raise RendezvousError("elastic.request_leave(): no session: call it while elastic.run (or elastic.init()) "
                              "runs")
    s.leave_request.request(str(reason)[:200], LeaveCause.PROGRAM)


def session_now(what: str) -> Session:
    """The process's session, for ``what`` (a State's commit, a collective); a clear error when
    there is none."""
    s = current.session()
    if s is None:
        raise RendezvousError(f"{what}: no ring: call elastic.init() (or run your function under @elastic.run) "
                              "first")
    return s
