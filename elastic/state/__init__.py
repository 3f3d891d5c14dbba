"""Committed training state: what a commit copies, how a sync moves it, where durable commits live.

``states`` holds ``State``, ``ObjectState`` and ``TorchState``; ``sync`` moves the most advanced
rank's commit to every rank; ``checkpoint`` writes and reads durable commits; ``sampler`` is the
``ElasticSampler`` a state commits. Imports the ring and the runtime, never the torch layer or
the sharded state above it.
"""

from elastic.state.sampler import ElasticSampler
from elastic.state.states import ObjectState, State, TorchState

__all__ = ["State", "ObjectState", "TorchState", "ElasticSampler"]
