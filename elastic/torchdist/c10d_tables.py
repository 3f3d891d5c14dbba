"""Every write into torch.distributed's private tables, in one place, with one check of their shape.

torch.distributed keeps its groups in private tables (``distributed_c10d._world``: the group map,
names, ranks, tags, the default group; the name resolver; DeviceMesh's group registry) and looks
up its object collectives as module attributes. The elastic group must be in those tables to be
the default group, to be passed as ``group=``, and to back a DeviceMesh; its object collectives
must replace torch's, which unpickle. Nothing else in elastic writes there. ``check()`` says in one
line what a torch version changed, and the suite runs it (tests/torchdist/test_c10d_tables.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

BACKEND = "elastic"

# What the writes below rely on: (object, attribute, what it must be).
_NEEDED = (
    (c10d, "_world", "torch.distributed's group tables"),
    (c10d, "_register_process_group", "the group-name resolver"),
    (c10d, "_resolve_process_group", "the group-name resolver"),
    (c10d, "_update_default_pg", "the default-group setter"),
    (c10d, "_get_default_group", "the default-group lookup"),
    (c10d, "_object_to_tensor", "the object collectives' encoder"),
    (c10d, "_tensor_to_object", "the object collectives' decoder"),
    (dist.Backend, "register_backend", "backend registration"),
)
_WORLD_TABLES = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg")


class TablesChanged(RuntimeError):
    """torch.distributed's private tables are not what this version of elastic-ring writes."""


def check() -> None:
    """Raises ``TablesChanged`` naming what torch (this version) lacks of what the writes below use."""
    missing: List[str] = [f"{getattr(o, '__name__', type(o).__name__)}.{name} ({what})"
                          for o, name, what in _NEEDED if not hasattr(o, name)]
    world = getattr(c10d, "_world", None)
    missing += [f"distributed_c10d._world.{t} (a dict)" for t in _WORLD_TABLES
                if not isinstance(getattr(world, t, None), dict)]
    if not hasattr(torch._C._distributed_c10d, "_set_global_rank"):
        missing.append("torch._C._distributed_c10d._set_global_rank")
    if missing:
        raise TablesChanged(f"torch {torch.__version__} changed the private torch.distributed tables the elastic "
                            f"group is entered in: missing {', '.join(missing)}; use a torch version this "
                            "elastic-ring supports (pyproject.toml)")


class _NoStore(dist.Store):
    """The elastic group's entry where torch keeps a group's key-value store: it has none (the
    rendezvous decides membership), so whatever asks for one gets a clear error, not a store
    that is local to this process and silently wrong."""

    def _none(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the elastic group has no torch.distributed key-value store (membership is the "
                                  "rendezvous server's)")

    set = get = add = wait = compare_set = delete_key = num_keys = check = set_timeout = _none


def _no_subgroups(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("torch.distributed.new_group / DeviceMesh: subgroups of the elastic group are not "
                              "supported (the world changes with every re-form)")


def register_backend() -> None:
    """new_group() on the default group makes a group of its backend: this one refuses, by name."""
    if BACKEND.upper() not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend(BACKEND, _no_subgroups, devices=["cpu"])


def enter_group(pg: Any, name: str) -> None:
    """Enters the group in torch.distributed's tables (its name, its ranks for the current world),
    so calls that pass ``group=`` (rooted ones look ranks up there) work whether or not it is the
    default group. Again after every sync: the world's size changes, and a script's
    ``destroy_process_group()`` empties the tables."""
    world = c10d._world
    if pg not in world.pg_map:
        world.pg_map[pg] = (BACKEND, _NoStore())
        world.pg_names[pg] = name
        world.pg_backend_config[pg] = f"cpu:{BACKEND}"
        world.pg_to_tag[pg] = f"ptd:{name}"
        for tag in (f"ptd:{name}", ""):
            if pg not in world.tags_to_pg.setdefault(tag, []):
                world.tags_to_pg[tag].append(pg)
    world.pg_group_ranks[pg] = {i: i for i in range(pg.size())}
    if world.default_pg is pg:
        torch._C._distributed_c10d._set_global_rank(pg.rank())


def entered_as(pg: Any) -> Any:
    """The name torch's tables hold for ``pg`` (None: not entered)."""
    return c10d._world.pg_names.get(pg)


def enter_world_view(view: Any, is_older_view: Callable[[Any], bool]) -> None:
    """Makes ``view`` the elastic group's world entry in the tables (rooted calls look ranks up
    there) in place of the previous world's (``is_older_view``), and registers its name with
    torch's resolver for good: a stale mesh resolves it and gets its clear error."""
    world = c10d._world
    for old in [pg for pg in world.pg_map if pg is not view and is_older_view(pg)]:
        for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config):
            table.pop(old, None)
    world.pg_map[view] = (BACKEND, _NoStore())
    world.pg_names[view] = view.group_name
    world.pg_group_ranks[view] = {i: i for i in range(view.size())}
    world.pg_backend_config[view] = f"cpu:{BACKEND}"
    try:
        c10d._resolve_process_group(view.group_name)
    except (RuntimeError, ValueError, KeyError):   # new, or unregistered by destroy_process_group()
        c10d._register_process_group(view.group_name, view)


def is_default(pg: Any) -> bool:
    return c10d._world.default_pg is pg


def make_default(pg: Any, name: str) -> None:
    """Makes ``pg`` torch.distributed's default group under ``name``."""
    for name_it in (lambda: pg._set_group_name(name), lambda: c10d._register_process_group(name, pg)):
        try:
            name_it()
        except RuntimeError:   # named already (installed before, then destroyed)
            pass
    c10d._update_default_pg(pg)
    enter_group(pg, name)


def enter_mesh_group(mesh: Any, view: Any) -> None:
    """Makes ``mesh`` (a 1-D DeviceMesh) run its one dimension on ``view``: DeviceMesh resolves
    its groups by name through its own registry."""
    mesh._dim_group_names = [view.group_name]
    mesh._pg_registry[view.group_name] = view


def replace_functions(public: Mapping[str, Callable], helpers: Mapping[str, Callable]) -> None:
    """Puts each function of ``public`` in ``torch.distributed`` and ``distributed_c10d`` in place
    of torch's function of that name, and each of ``helpers`` in ``distributed_c10d``; each is
    called with torch's own first. Once: torch's own are the ones there before."""
    if getattr(getattr(c10d, next(iter(public))), "_elastic_replaces", None) is not None:
        return

    def replaced(ours: Callable, theirs: Callable) -> Callable:
        @functools.wraps(theirs)
        def call(*args: Any, **kwargs: Any) -> Any:
            return ours(theirs, *args, **kwargs)
        call._elastic_replaces = theirs   # type: ignore[attr-defined]
        return call

    installed: Dict[str, Callable] = {name: replaced(fn, getattr(c10d, name))
                                      for name, fn in {**public, **helpers}.items()}
    for name, fn in installed.items():
        setattr(c10d, name, fn)
        if name in public:
            setattr(dist, name, fn)


def wrap(name: str, make: Callable[[Callable], Callable], also_in: Sequence[Any] = ()) -> None:
    """Replaces torch's function ``name`` of ``distributed_c10d`` with ``make(torch's own)``, in
    ``distributed_c10d`` and in each module of ``also_in`` that imported it by name."""
    wrapper = make(getattr(c10d, name))
    setattr(c10d, name, wrapper)
    for module in also_in:
        setattr(module, name, wrapper)
