"""elastic-ring: elastic, fault-tolerant data-parallel training for PyTorch.

Workers that die, hang or join are handled without restarting the survivors: the ring is
aborted, re-formed for a new world version, and the last committed state is restored (on a
failure) or kept (on a clean join or leave) and synced to everyone. See ``elastic.run``.

The package is layered, lowest first: ``elastic.ring`` (the native core's owner), ``elastic.runtime``
(the worker's session), ``elastic.state`` (committed state), ``elastic.torchdist`` (torch.distributed
on the ring), ``elastic.sharded`` (FSDP2 state), ``elastic.run`` and ``elastic.launch`` on top.
"""

from rendezvous import __version__  # the distribution's version, from its metadata

from elastic.ring.communicator import CommConfig, Communicator, ErrorKind, Handle, Listener
from elastic.ring.errors import (BadPeerError, CollectiveMismatchError, ElasticError, HandshakeError,
                                 SettingsMismatchError, WorkerLostError)
from elastic.ring.ops import Average, Max, Min, ReduceOp, Sum
from elastic.run import run
from elastic.runtime.collectives import (allgather, allreduce, allreduce_, allreduce_async_, barrier, broadcast_,
                                         broadcast_object, synchronize)
from elastic.runtime.errors import (ElasticTimeout, EvictedAsStraggler, LeaveRequested, LeftJob, MembershipChanged,
                                    Outvoted, Preempted, RendezvousError)
from elastic.runtime.lifecycle import init, request_leave, shutdown
from elastic.runtime.world import cross_rank, cross_size, local_rank, local_size, rank, size, world_version
from elastic.state.errors import SyncRefusedError
from elastic.state.sampler import ElasticSampler
from elastic.state.states import ObjectState, State, TorchState
from elastic.torchdist import guidance as _torch_guidance
from elastic.torchdist.errors import StaleMeshError

# Under elastic-run only (ELASTIC_WORKER_ID): torch's errors about a missing default group or
# torch's own DDP name our fix. Armed here, explicitly, because a torchrun script reaches those
# errors at its top level, before any elastic call; it installs nothing outside elastic-run.
_torch_guidance.install_when_torch_loads()


def __getattr__(name):
    # torch-dependent names load lazily so numpy-only use does not import torch.
    if name in ("DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state"):
        from elastic.torchdist import optimizer
        return getattr(optimizer, name)
    if name in ("ShardedState", "CommitLostError"):
        from elastic.sharded import sharded_state
        return getattr(sharded_state, name)
    if name == "DistributedDataParallel":
        from elastic.torchdist import ddp
        return ddp.DistributedDataParallel
    if name == "process_group":
        from elastic.torchdist import group
        return group.process_group
    if name == "device_mesh":
        from elastic.torchdist import mesh
        return mesh.device_mesh
    raise AttributeError(f"module 'elastic' has no attribute {name!r}")


__all__ = [
    "allgather", "allreduce", "allreduce_", "allreduce_async_", "barrier", "broadcast_", "broadcast_object",
    "synchronize", "CommConfig", "Communicator", "ErrorKind", "Handle", "Listener", "BadPeerError",
    "CollectiveMismatchError", "ElasticError", "ElasticTimeout", "HandshakeError", "MembershipChanged",
    "LeftJob", "Preempted", "LeaveRequested", "EvictedAsStraggler", "Outvoted", "RendezvousError",
    "SettingsMismatchError",
    "StaleMeshError", "SyncRefusedError", "WorkerLostError", "Average", "Max", "Min", "ReduceOp", "Sum", "run",
    "init", "request_leave", "shutdown", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "world_version", "ElasticSampler", "State", "ObjectState", "TorchState", "DistributedOptimizer",
    "DistributedDataParallel", "process_group", "device_mesh", "broadcast_parameters", "broadcast_optimizer_state",
    "ShardedState", "CommitLostError",
]
