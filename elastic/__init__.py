"""elastic-ring: elastic, fault-tolerant data-parallel training for PyTorch.

A ring-allreduce core in C++ (``elastic._native``) with collectives that fail fast
when a peer dies, hangs or is fenced out, so survivors re-form instead of restarting.
"""

from .collectives import (
    allgather,
    allreduce,
    allreduce_,
    allreduce_async_,
    barrier,
    broadcast_,
    broadcast_object,
    synchronize,
)
from .communicator import CommConfig, Communicator, Handle, Listener
from .errors import (
    CollectiveMismatchError,
    ElasticError,
    ElasticTimeout,
    HandshakeError,
    MembershipChanged,
    RendezvousError,
    WorkerLostError,
)
from .ops import Average, Max, Min, ReduceOp, Sum

__version__ = "0.1.0"

__all__ = [
    "allgather", "allreduce", "allreduce_", "allreduce_async_", "barrier", "broadcast_", "broadcast_object",
    "synchronize", "CommConfig", "Communicator", "Handle", "Listener", "CollectiveMismatchError", "ElasticError",
    "ElasticTimeout", "HandshakeError", "MembershipChanged", "RendezvousError", "WorkerLostError", "Average", "Max",
    "Min", "ReduceOp", "Sum",
]
