"""torchrun's RANK and WORLD_SIZE in the worker's own environment, true for the current world.

A rank changes with every world and does not exist before the first, so the launcher cannot set
them; the runtime sets them in its process's environment (os.environ) as each world forms, for
libraries and scripts that read them (they keep the last world's values after elastic.run
returns, as elastic.rank() does). Read them inside the training function, or better call
elastic.rank() / elastic.size(), which cannot be stale. LOCAL_RANK (the worker's slot on its
host) and LOCAL_WORLD_SIZE stay what elastic-run set: they do not change with worlds.
"""

from __future__ import annotations

import os


def publish(rank: int, size: int) -> None:
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(size)
