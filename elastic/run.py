"""``elastic.run``: the loop that keeps a training function going across failures and world changes.

    join and form the ring -> sync state -> func(state)
      WorkerLostError   : restore the last commit, report the suspect, wait for the next world
                          (BadPeerError too: a neighbour with an unusable address, or one that
                          does not prove the job's secret, is reported to be evicted)
      HandshakeError    : an authenticated neighbour is at another world version: restore and
                          take the next world
      MembershipChanged : keep the state, form the next world
    then reset callbacks, sync, and call func again. A failure while forming or syncing is
    handled like any other. Any other exception ends this worker with its traceback, among
    them SettingsMismatchError (the workers' ring settings differ: no later world fixes that).
    What to do is decided by the exception's type, never by its text.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Optional

from . import runtime
from .errors import HandshakeError, MembershipChanged, RendezvousError, WorkerLostError
from .state import State

log = logging.getLogger("elastic")


def run(func: Optional[Callable] = None, *, checkpoint_dir: Optional[str] = None, checkpoint_every: int = 10,
        reset_limit: Optional[int] = None) -> Callable:
    """Decorator: ``@elastic.run`` or ``@elastic.run(checkpoint_dir=..., checkpoint_every=10)``.

    The decorated function takes the ``State`` as its first argument. ``checkpoint_dir`` turns
    on durable commits (every ``checkpoint_every``-th commit is written by rank 0); ``reset_limit``
    (default ``ELASTIC_RESET_LIMIT``, 0 = none) bounds the number of re-forms.
    """
    if func is None:
        return lambda f: run(f, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                             reset_limit=reset_limit)

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"elastic.run: the first argument must be an elastic State, got {type(state).__name__}")
        if checkpoint_dir:
            state.enable_durable_commits(checkpoint_dir, checkpoint_every)
        rt = runtime.init(form=False)  # join only: forming happens in the loop, with recovery
        limit = rt.config.reset_limit if reset_limit is None else reset_limit
        resets = 0
        first = True
        min_version = 1
        success: Optional[bool] = False
        try:
            while True:
                try:
                    if rt.comm is None or rt.comm.failed or rt.world.version < min_version:
                        started = time.monotonic()
                        rt.form(rt.next_world(min_version))
                        log.info("worker %s is rank %d of %d in world version %d (formed in %.3f s)",
                                 rt.config.worker_id, rt.world.rank, rt.world.size, rt.world.version,
                                 time.monotonic() - started)
                    if not first:
                        state.on_reset()
                    # The most advanced rank's state, after its reset callbacks, goes to everyone.
                    state.sync()
                    first = False
                    result = func(state, *args, **kwargs)
                    success = True
                    return result
                except WorkerLostError as e:
                    current = rt.world.version if rt.world is not None else 0
                    failed_version = max(e.world_version, current)
                    log.warning("%s; restoring commit %d", e, state.commit_step)
                    state.restore()
                    rt.report_failure(e)
                    min_version = failed_version + 1
                except HandshakeError as e:
                    # A neighbour is at another world version: ours is stale, take the next one.
                    log.warning("%s", e)
                    state.restore()
                    min_version = (rt.world.version if rt.world is not None else 0) + 1
                except MembershipChanged as e:
                    log.info("%s", e)
                    min_version = rt.world.version + 1
                resets += 1
                if limit and resets > limit:
                    raise RendezvousError(f"elastic.run: gave up after {limit} re-forms (reset limit)")
        except runtime.JobFinished as e:
            if e.succeeded:
                log.info("%s", e)
                success = None  # another worker reported success; nothing more to say
                return None
            raise
        finally:
            runtime.shutdown(success)

    return wrapper
