"""Copies of the live state for a commit (``copy_into``); CUDA tensors to pinned host memory, on a side stream.

``State.save`` copies the live state into its commit. A CUDA tensor is copied into pinned host
memory (reused from the spare commit where it fits), on a side stream per device that first
waits for the work queued on the device's current stream (the values the step left): the copies
run on the copy engines while the GPU goes on, and ``finish`` waits for them. No commit holds
GPU memory, so none grows with commits or worlds; a restore copies the commit back into the live
tensors (``load_state_dict``). CPU tensors never come here: a CPU commit is what it always was.
"""

from __future__ import annotations

import collections
import copy
import sys
from typing import Any, Dict, Optional

from elastic.runtime import current


class HostCopies:
    """One commit's copies of CUDA tensors (see the module doc). A device communicator aborted
    meanwhile may have cut a collective short and left garbage in what was copied: ``finish``
    then raises the failure the session noted, before the commit is taken (``State.
    _take_snapshot`` replaces the last commit only afterwards), so the commit before stays."""

    def __init__(self) -> None:
        self._streams: Dict[Any, Any] = {}

    def copy(self, old: Any, new: Any) -> Any:
        torch = sys.modules["torch"]
        stream = self._streams.get(new.device)
        if stream is None:
            stream = torch.cuda.Stream(new.device)
            stream.wait_stream(torch.cuda.current_stream(new.device))
            self._streams[new.device] = stream
        if isinstance(old, torch.Tensor) and old.device.type == "cpu" and old.is_pinned() and \
                old.shape == new.shape and old.dtype == new.dtype and old.is_contiguous():
            host = old
        else:
            host = torch.empty(new.shape, dtype=new.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(new.detach(), non_blocking=True)
        return host

    def finish(self) -> None:
        if not self._streams:
            return   # no CUDA tensor: a CPU commit, as it always was
        for stream in self._streams.values():
            stream.synchronize()
        s = current.session()
        failure = s.noted_failure() if s is not None else None
        if failure is not None:
            raise failure


def copy_into(old: Any, new: Any, host: Optional[HostCopies] = None) -> Any:
    """A deep copy of ``new``, reusing ``old``'s tensors where structure, shape and dtype match;
    with ``host``, CUDA tensors are copied into pinned host memory (``HostCopies``)."""
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is imported
    if torch is not None and isinstance(new, torch.Tensor):
        if host is not None and new.is_cuda:
            return host.copy(old, new)
        if isinstance(old, torch.Tensor) and old.shape == new.shape and old.dtype == new.dtype:
            return old.copy_(new.detach())
        return new.detach().clone()
    if isinstance(new, dict):
        old = old if isinstance(old, dict) else {}
        if type(new) is collections.OrderedDict:  # a state_dict(): keep its type and _metadata
            out = collections.OrderedDict((k, copy_into(old.get(k), v, host)) for k, v in new.items())
            if getattr(new, "_metadata", None) is not None:
                out._metadata = copy.deepcopy(new._metadata)
            return out
        return {k: copy_into(old.get(k), v, host) for k, v in new.items()}
    if isinstance(new, (list, tuple)):
        old = old if isinstance(old, type(new)) and len(old) == len(new) else [None] * len(new)
        return type(new)(copy_into(o, v, host) for o, v in zip(old, new))
    return copy.deepcopy(new)


__all__ = ["HostCopies", "copy_into"]
