"""Errors that name elastic-ring's fix where torch's own would send a torchrun user astray.

What a torchrun script does that cannot work under elastic-run fails deep inside torch with
advice that is wrong here: asking ``torch.distributed`` for a rank or a collective where no
default group exists (torch says "call init_process_group"; here the default group is the
elastic ring, which ``elastic.run`` installs); calling ``init_process_group()`` itself (torch
says "environment variable RANK expected"); building torch's ``DistributedSampler`` before a
world exists (it names init_process_group, not ``ElasticSampler``) or its own
``DistributedDataParallel`` (its reducer keeps the world size it was built with, and fails with
"all_gather: expected 2 output tensors"). Each raises one line naming what to do instead; a
``DistributedSampler`` built inside a run warns that it does not follow re-forms.

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
import warnings
from typing import Any

# Set by elastic-run for each worker it starts (elastic.runtime.worker_config reads it).
WORKER_ENV = "ELASTIC_WORKER_ID"
_DDP_MODULE = "torch.nn.parallel.distributed"
_SAMPLER_MODULE = "torch.utils.data.distributed"

NO_DEFAULT_GROUP = (
    "torch.distributed has no default group here: under elastic-run it is the elastic ring, installed when "
    "the @elastic.run function starts and kept after it returns until dist.destroy_process_group(); call "
    "dist.get_rank() and collectives inside that function, remove dist.init_process_group(), and use "
    "elastic.ElasticSampler where a DistributedSampler asks for the world size")
NO_INIT = (
    "dist.init_process_group() cannot run here: under elastic-run the default group is the elastic ring, which "
    "@elastic.run installs for each world (there is no RANK before one exists); remove the call (guard it with "
    "`if \"ELASTIC_WORKER_ID\" not in os.environ` for a script that also runs under torchrun)")
INIT_INSIDE_RUN = (
    "dist.init_process_group(): inside @elastic.run the default group is already the elastic ring; remove the "
    "call (dist.* calls work on it as they are)")
TORCH_SAMPLER = (
    "torch's DistributedSampler takes one world's size and rank when it is built, and there is no world here yet "
    "under elastic-run: use elastic.ElasticSampler(dataset, shuffle=..., seed=...), which follows every world and "
    "resumes mid-epoch (call sampler.record_batch(i, len(batch)) after each step)")
TORCH_SAMPLER_IN_RUN = (
    "torch's DistributedSampler keeps this world's size and rank: after a re-form its shards overlap or leave "
    "samples out; use elastic.ElasticSampler(dataset, shuffle=..., seed=...) to follow every world")
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
    c10d_tables.wrap("_get_default_group", guided, also_in=(ddp_module,))
    c10d_tables.wrap("init_process_group", _guided_init(c10d), also_in=(dist,))
    sampler_module = sys.modules.get(_SAMPLER_MODULE)   # torch loads it before DDP's module
    if sampler_module is not None:
        _guide_sampler(sampler_module.DistributedSampler, c10d)

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


def _guided_init(c10d: Any) -> Any:
    """torch's ``init_process_group``, refusing with our fix what cannot work under elastic-run."""
    def make(original: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            try:
                given = signature.bind(*args, **kwargs).arguments
            except TypeError:
                given = {}   # torch's own error about the arguments says it better
            if c10d.is_initialized() and _is_elastic(c10d.GroupMember.WORLD):
                raise ValueError(INIT_INSIDE_RUN)
            from_env = given.get("store") is None and given.get("init_method") in (None, "env://")
            if from_env and "RANK" not in os.environ:
                raise ValueError(NO_INIT)
            return original(*args, **kwargs)
        return init_process_group
    return make


def _guide_sampler(sampler: Any, c10d: Any) -> None:
    """torch's DistributedSampler fixes one world's size and rank: refused where no world exists
    (it would fail there anyway), a warning inside a run; both name ElasticSampler."""
    original_init = sampler.__init__
    signature = inspect.signature(original_init)

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if type(self) is sampler:
            try:
                given = signature.bind(self, *args, **kwargs).arguments
            except TypeError:
                given = {}
            if given.get("num_replicas") is None and not c10d.is_initialized():
                raise TypeError(TORCH_SAMPLER)
            if c10d.is_initialized() and _is_elastic(c10d.GroupMember.WORLD):
                warnings.warn(TORCH_SAMPLER_IN_RUN, stacklevel=2)
        original_init(self, *args, **kwargs)

    sampler.__init__ = __init__


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
