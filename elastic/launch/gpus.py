"""Which GPUs elastic-run places its workers on: one GPU per worker, the same GPU for a slot's whole life.

A pure function of the launcher's environment and flags (tests/gpu/test_placement.py). The GPUs
this launcher may hand out are found without importing torch (the launcher stays light, and a
CUDA context in the launcher would be inherited by nothing useful): its own
``CUDA_VISIBLE_DEVICES`` when set (an allocation from Slurm or a container runtime: those names,
indices or UUIDs, in that order), else the NVIDIA driver's ``/proc/driver/nvidia/gpus`` (one
entry per GPU: indices 0..n-1, as CUDA numbers them), else none.

``--gpus-per-host N`` (default: the GPUs found; 0: no placement, ``CUDA_VISIBLE_DEVICES`` is left
as inherited) gives slot s the s-th of the first N GPUs. Each worker's ``CUDA_VISIBLE_DEVICES``
names its one GPU, so inside it that GPU is device 0 and ``.cuda()`` is right as written;
``LOCAL_RANK`` is 0 to match (``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))``, what a
torchrun script does, picks that GPU), and the slot stays in ``ELASTIC_LOCAL_SLOT``. A respawned
worker takes its slot, and so its predecessor's GPU. More workers than GPUs is an error.
"""

from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Sequence, Tuple

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def visible_gpus(env: Mapping[str, str], proc_dir: str = NVIDIA_GPUS) -> Tuple[str, ...]:
    """The GPUs this launcher may hand out, as ``CUDA_VISIBLE_DEVICES`` would name them."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        names = []
        for name in (n.strip() for n in listed.split(",")):
            if not name or name.startswith("-"):
                break   # CUDA ignores every device after an invalid entry ("-1": none at all)
            names.append(name)
        return tuple(names)
    try:
        found = [e for e in os.listdir(proc_dir) if not e.startswith(".")]
    except OSError:
        return ()
    return tuple(str(i) for i in range(len(found)))


def placement(gpus_per_host: Optional[int], visible: Sequence[str], np: int, discovery: bool) -> Tuple[str, ...]:
    """The GPU of each slot (slot s takes the s-th), or () for no placement; ``ValueError`` saying
    what to change when ``--np`` (``np``) or ``--gpus-per-host`` cannot be met."""
    if gpus_per_host is None:
        gpus_per_host = len(visible)
    if gpus_per_host < 0:
        raise ValueError(f"--gpus-per-host must not be negative, got {gpus_per_host}")
    if gpus_per_host == 0:
        return ()
    if visible and gpus_per_host > len(visible):
        raise ValueError(f"--gpus-per-host {gpus_per_host}, but this host shows {len(visible)} GPU(s) "
                         f"({','.join(visible)})")
    gpus = tuple(visible[:gpus_per_host]) if visible else tuple(str(i) for i in range(gpus_per_host))
    if np > len(gpus) and not discovery:
        raise ValueError(f"--np {np} workers, but {len(gpus)} GPU(s) to place them on (one worker per GPU, "
                         f"--gpus-per-host): lower --np, or give --gpus-per-host 0 to place no worker on a GPU")
    return gpus


def gpu_env(gpus: Sequence[str], slot: int) -> Dict[str, str]:
    """The variables that give the worker of ``slot`` its GPU (nothing without placement)."""
    if not gpus:
        return {}
    if slot >= len(gpus):
        raise ValueError(f"slot {slot} has no GPU: {len(gpus)} GPU(s) for one worker each (--gpus-per-host)")
    return {"CUDA_VISIBLE_DEVICES": gpus[slot], "LOCAL_RANK": "0"}


__all__ = ["NVIDIA_GPUS", "gpu_env", "placement", "visible_gpus"]
