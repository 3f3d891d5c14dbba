"""The torch layer's part in the step protocol, attached to a session when its run starts.

``attach(session)`` (``elastic.run`` calls it where torch.distributed is there) hands the session
one ``TorchHooks``: the elastic group becomes the default group as the run starts, and after every
sync the group's tables follow the new world and every ``DistributedDataParallel`` rebuilds its
reducer on the session's ring (DDPs outside the state get the sync root's weights first). A
session joined to a job also gets its device communicators, one per world
(``elastic.torchdist.device_layer``).
"""

from __future__ import annotations

from typing import Any

from elastic.runtime.hooks import StepHooks
from elastic.runtime.session import Session
from elastic.torchdist import c10d_tables, ddp, device_layer, group


class TorchHooks(StepHooks):
    def __init__(self, session: Session) -> None:
        self.session = session

    def run_starting(self, default_group: bool) -> None:
        group.install_default_group(default_group)

    def after_sync(self, state: Any, root: int) -> None:
        c10d_tables.enter_group(group.process_group(), group.GROUP_NAME)   # the world's size changed
        ddp.after_sync(self.session, state, root)


def attach(session: Session) -> None:
    """Makes ``session`` run the torch layer's hooks (once per session)."""
    if device_layer.layer_of(session) is None and getattr(session, "client", None) is not None:
        session.add_hooks(device_layer.DeviceWorlds.for_session(session))   # before the DDPs' after_sync
    if not any(isinstance(h, TorchHooks) for h in session.hooks):
        session.add_hooks(TorchHooks(session))
