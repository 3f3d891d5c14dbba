"""``elastic.device_mesh()``: torch's DeviceMesh over the current world, made anew for each world.

FSDP2 and DTensor fix a world into what they build: a module's shards are cut for the mesh's
size, each rank's piece chosen by its rank. A mesh must therefore not outlive its world; one
that ran on in the next world would gather shards in the wrong order or cut tensors for the
wrong size. So a mesh holds its world's view of the elastic group
(``ElasticProcessGroup.world_view()``): the world's rank and size, fixed, and a name of its own
(``elastic/world<version>``) under which torch.distributed resolves it; once that world is
over, every collective on it raises ``elastic.StaleMeshError`` naming ``elastic.device_mesh()``.
That holds however the mesh was made: here, with ``DeviceMesh.from_group(elastic.process_group(),
"cpu")``, or with ``init_device_mesh("cpu", (n,))`` on the elastic default group (both take the
process group's ``group_name``, which is its current world view's, and DeviceMesh resolves its
groups by name).

DeviceMesh compares by its ranks, so two worlds of one size have equal meshes, and DTensor's
sharding caches (keyed on the mesh) would hand a model rebuilt in the new world the old mesh:
the caches are cleared when a world's view is made, and the meshes made here carry their
world's identity besides (see below), so that torch tells them apart everywhere (DTensor ops
mixing two worlds fail, torch.compile guards recompile).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch.distributed.device_mesh import DeviceMesh

from elastic.torchdist import c10d_tables
from elastic.torchdist.group import process_group


def device_mesh(device_type: Any = "cpu", mesh_dim_names: Optional[Sequence[str]] = None) -> DeviceMesh:
    """A 1-D ``torch.distributed.device_mesh.DeviceMesh`` over the current world, on
    ``device_type``: ``"cpu"`` (the ring) or ``"cuda"`` (the world's NCCL communicator: FSDP2's
    gathers and reduce-scatters of CUDA shards run there). It is what ``fully_shard(module,
    mesh=...)``, ``distribute_tensor`` and the DTensor and ``torch.distributed.checkpoint.state_dict``
    APIs take.

    One mesh per world and device type (the same object for every call in that world): the
    world's rank and size are fixed into it. Make it, and everything sharded on it, inside the
    training function, for each world; used in a later world, its collectives raise
    ``elastic.StaleMeshError``. ``mesh_dim_names`` names the one dimension (e.g. ``("dp",)``;
    passed alone, as the first argument, it keeps the CPU). Needs a current world: call it
    inside ``elastic.run``.
    """
    if not isinstance(device_type, str):   # device_mesh(("dp",)): the names, on the CPU
        device_type, mesh_dim_names = "cpu", device_type
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"elastic.device_mesh: device_type {device_type!r}; use 'cpu' (the ring) or 'cuda' (the "
                         "world's NCCL communicator)")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    if names is not None and len(names) != 1:
        raise ValueError(f"elastic.device_mesh: the elastic world has one dimension; got mesh_dim_names={names}")
    view = process_group().world_view()
    with view._lock:   # the world's view keeps its world's meshes, one per device type
        made = view.meshes.get(device_type)
        if made is not None and made.mesh_dim_names == names:
            return made
        # The rank is the view's, not read from torch's default group, so the mesh is right
        # whether or not the elastic group is the default group.
        mesh = DeviceMesh(device_type, list(range(view.size())), mesh_dim_names=names, _init_backend=False,
                          _rank=view.rank())
        c10d_tables.enter_mesh_group(mesh, view)
        # DeviceMesh compares and hashes (and torch.compile guards it) by ranks, layout, names
        # and _thread_id, so meshes of two worlds of one size would be equal, and DTensor's
        # sharding caches, keyed on the mesh, would hand this world's tensors the old mesh.
        # _thread_id is the field that tells apart meshes of the same ranks (torch sets it for
        # its threaded test backend); here it is the world's name.
        mesh._thread_id = view.group_name
        view.meshes[device_type] = mesh
    return mesh


__all__ = ["device_mesh"]
