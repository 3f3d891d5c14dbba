"""``elastic.run``: the decorator that runs a training function under the worker's job session,
which keeps it going across failures and world changes. The step protocol it runs (form, sync,
the function, commits; what each error leads to) is described once, in ``elastic.runtime.session``.
Any exception the protocol does not handle ends this worker with its traceback, among them
SettingsMismatchError (the workers' ring settings differ: no later world fixes that). What to
do is decided by the exception's type, never by its text (``elastic.runtime.reaction.after_error``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from elastic.runtime import lifecycle
from elastic.runtime.session import Session
from elastic.state.states import State


def run(func: Optional[Callable] = None, *, checkpoint_dir: Optional[str] = None, checkpoint_every: int = 10,
        reset_limit: Optional[int] = None) -> Callable:
    """Decorator: ``@elastic.run`` or ``@elastic.run(checkpoint_dir=..., checkpoint_every=10)``.

    The decorated function takes the ``State`` as its first argument. ``checkpoint_dir`` turns
    on durable commits (every ``checkpoint_every``-th commit is written by rank 0, on a background
    thread, finished before ``run`` returns); ``reset_limit``
    (default ``ELASTIC_RESET_LIMIT``, 0 = none) bounds the number of re-forms.

    Returns what the function returns. A worker that the job finished without (another
    worker reported success while this one waited for a world) returns None. Afterwards
    ``elastic.rank()``, ``size()`` … answer with the last world's values and collectives
    raise an error saying the job has finished.

    Graceful leave: while it runs, from before it joins the job, SIGTERM and SIGINT (the
    previous handlers are put back when it ends; a second signal of the same kind does what the
    previous handler did, except a SIGTERM within 2 s of the first, which is absorbed even after
    the call ended: Slurm and elastic-run both deliver one) and ``elastic.request_leave()``
    only ask this worker to leave. At its next commit boundary (``state.commit()`` /
    ``check_membership()``, or at once while it waits for a world, or once its join is
    answered, or, while no server answers its join, after the attempt under way) it leaves the
    job and the call raises ``elastic.LeftJob`` instead of returning: ``elastic.Preempted`` for a
    signal, ``elastic.LeaveRequested`` for ``request_leave()``, ``elastic.EvictedAsStraggler`` when
    the straggler policy ``evict`` chose it. A ``SystemExit`` with code 0, so uncaught, the process
    exits 0 without running the code after the call (``except Exception`` does not catch it;
    ``except elastic.LeftJob`` does), and the other workers go on with their state. A worker that
    reaches no commit boundary within ``ELASTIC_PREEMPT_GRACE`` seconds (default 30;
    ``elastic-run --preempt-grace``) after the request ends with exit status 143 after a log line,
    and the others restore their last commit as for any lost worker.
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
        s = lifecycle.init_for_run()  # join only: forming happens in the loop, with recovery
        _attach_torch(s)
        limit = s.config.reset_limit if reset_limit is None else reset_limit
        return s.run(func, state, args, kwargs, limit)

    return wrapper


def _attach_torch(session: Session) -> None:
    """Attaches the torch layer to the run where torch.distributed is there (numpy-only installs
    lack it): the default group, DDP's reducers after each sync, on every rank alike."""
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if dist.is_available():
        from elastic.torchdist import step_hooks
        step_hooks.attach(session)
