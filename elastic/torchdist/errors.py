"""The torch layer's exception: a DeviceMesh used after its world."""

from __future__ import annotations

from elastic.ring.errors import ElasticError


class StaleMeshError(ElasticError, RuntimeError):
    """A DeviceMesh (or an FSDP module or DTensor made on it) of a world that is over was used:
    its collectives would gather and reduce the wrong shards in the new world. Make the mesh
    and what is sharded on it again in each world with ``elastic.device_mesh()``.
    ``world_version`` is the mesh's world, ``current_world_version`` the world now."""

    __module__ = "elastic"   # its public name, whatever module defines it

    def __init__(self, message: str, *, world_version: int = -1, current_world_version: int = -1):
        super().__init__(message)
        self.world_version, self.current_world_version = world_version, current_world_version
