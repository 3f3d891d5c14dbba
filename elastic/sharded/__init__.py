"""Sharded training state: an FSDP2 model committed in memory on its owner and a buddy, resharded
onto every new world, durable in DCP's format.

``sharded_state`` holds ``ShardedState``; ``reshard`` decides which commit a world resumes from
and who sends which rows (pure); ``transfer`` moves and checks shards; ``checkpoint`` writes and
reads durable sharded commits. The top of the training layers: imports the ring, the runtime,
the state and the torch layer.
"""

from elastic.sharded.sharded_state import CommitLostError, ShardedState

__all__ = ["ShardedState", "CommitLostError"]
