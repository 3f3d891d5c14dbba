"""Errors that name elastic-ring's fix where torch's own would send a torchrun user astray.

Two things a torchrun script does that cannot work under elastic-run fail deep inside torch
with advice that is wrong here: asking ``torch.distributed`` for a rank or a collective where
no default group exists (torch says "call init_process_group"; here the default group is the
elastic ring, which ``elastic.run`` installs), and building torch's own
``DistributedDataParallel`` (its reducer keeps the world size it was built with, and fails
with "all_gather: expected 2 output tensors"). Both raise one line naming what to do instead.

Only in a worker that elastic-run started, and only once torch has loaded: scripts import
``elastic`` before or after ``torch``, and a numpy-only worker must not pay for importing
torch, so a finder on ``sys.meta_path`` installs the wrappers right after torch's DDP module
(which ``import torch`` loads, together with ``torch.distributed``) has run.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import os
import sys
from typing import Any

# Set by elastic-run for each worker it starts (elastic.runtime.worker_config reads it).
WORKER_ENV = "ELASTIC_WORKER_ID"
_DDP_MODULE = "torch.nn.parallel.distributed"

NO_DEFAULT_GROUP = (
    "torch.distributed has no default group here: under elastic-run it is the elastic ring, installed when "
    "the @elastic.run function starts and kept after it returns until dist.destroy_process_group(); call "
    "dist.get_rank() and collectives inside that function, and remove dist.init_process_group()")
TORCH_DDP = (
    "torch's DistributedDataParallel cannot run on the elastic ring (its reducer keeps the world size it "
    "was built with): use elastic.DistributedDataParallel(module, ...) with the same arguments "
    "(from elastic import DistributedDataParallel as DDP), built before @elastic.run's function")

def install_when_torch_loads() -> None:
    """In a worker of elastic-run: installs the wrappers now if torch is loaded, else once it is."""
    if WORKER_ENV not in os.environ or _installed():
        return
    if _DDP_MODULE in sys.modules:
        install()
    elif not any(isinstance(f, _AfterTorchLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchLoads())


def _installed() -> bool:
    """Whether torch's DDP constructor is ours already (the mark is on torch's object, not here)."""
    ddp_module = sys.modules.get(_DDP_MODULE)
    return ddp_module is not None and getattr(ddp_module.DistributedDataParallel.__init__, "_elastic_guidance", False)


def install() -> None:
    """Wraps torch's default-group lookup and DDP's constructor (idempotent)."""
    # From sys.modules: this may run while ``import torch`` itself is still under way.
    dist = sys.modules.get("torch.distributed")
    ddp_module = sys.modules.get(_DDP_MODULE)
    if dist is None or ddp_module is None or not dist.is_available() or _installed():
        return
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    from elastic.torchdist import c10d_tables   # torch.distributed is loaded by now

    def guided(original_lookup):
        @functools.wraps(original_lookup)
        def _get_default_group():
            if not c10d.is_initialized():
                raise ValueError(NO_DEFAULT_GROUP)
            return original_lookup()
        return _get_default_group

    # torch's DDP module imported the function by name: both names must see the wrapper.
    c10d_tables.wrap_default_group_lookup(guided, ddp_module)

    torch_ddp = ddp_module.DistributedDataParallel
    original_init = torch_ddp.__init__
    signature = inspect.signature(original_init)

    @functools.wraps(original_init)
    def __init__(self, module: Any, *args: Any, **kwargs: Any) -> None:
        # elastic.DistributedDataParallel is a subclass that passes the ring itself; a group
        # the script made by hand (another backend) is its own business.
        if type(self) is torch_ddp:
            try:
                group = signature.bind(self, module, *args, **kwargs).arguments.get("process_group")
            except TypeError:
                group = None   # torch's own error about the arguments says it better
            if group is None and c10d.is_initialized():
                group = c10d.GroupMember.WORLD
            if group is None or _is_elastic(group):
                raise TypeError(TORCH_DDP)
        original_init(self, module, *args, **kwargs)

    __init__._elastic_guidance = True   # type: ignore[attr-defined]
    torch_ddp.__init__ = __init__


def _is_elastic(group: Any) -> bool:
    from elastic.torchdist.group import ElasticProcessGroup
    return isinstance(group, ElasticProcessGroup)


class _AfterTorchLoads(importlib.abc.MetaPathFinder):
    """Finds torch's DDP module with the other finders and installs the wrappers after it ran."""

    def find_spec(self, name: str, path: Any, target: Any = None):
        if name != _DDP_MODULE:
            return None
        sys.meta_path.remove(self)   # once: the real spec comes from the finders after this one
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            install()

        spec.loader.exec_module = exec_module
        return spec
