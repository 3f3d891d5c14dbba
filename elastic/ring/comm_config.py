"""The ring core's settings: one dataclass, read from flags or the environment, checked by the core."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from elastic.ring import _native

_CORE = _native.CommConfig()  # the core's defaults: each setting's default is written once, in native/src/base/config.h


def _setting(name: str, env: str) -> Any:
    """A CommConfig field: its default from the core, and the environment variable that sets it."""
    return dataclasses.field(default=getattr(_CORE, name), metadata={"env": env})


@dataclasses.dataclass(frozen=True)
class CommConfig:
    """Settings of the ring core; the one place they are read from flags or environment.

    Defaults come from the core (``elastic.ring._native.CommConfig``), which also checks every value:
    a bad one raises ``ValueError`` naming the setting (and the variable, from ``from_env``).

    ``algorithm`` (env ELASTIC_ALLREDUCE_ALGORITHM) picks the allreduce: "ring" (the flat ring
    always), "hierarchical" (in a mixed world: host-local ring over shared memory, ring of one
    leader per host over TCP, host-local broadcast, pipelined by chunks), or "auto" (default:
    hierarchical where it applies and the buffer is larger than ``hierarchical_bytes``, env
    ELASTIC_HIERARCHICAL_BYTES, 4 MiB; else the ring). It applies when ``hosts`` name at least
    two hosts, one of them with two or more ranks, and each host's ranks are contiguous in rank
    order; elsewhere every allreduce takes the ring. Results are identical on every rank either
    way (not bit-identical between the two algorithms for floats: the summation order differs);
    see native/README.md, "Hierarchical allreduce". ``transport`` "auto" lets ring neighbours
    with the same name in ``hosts`` exchange data through shared memory, "tcp" keeps every link
    on TCP. Keep these settings the same on every rank (``connect()`` checks, and fails on every
    rank naming the setting that differs). ``dead_link_timeout`` (env ELASTIC_DEAD_LINK_TIMEOUT,
    30 s) is how long a ring connection may go without the peer's kernel acknowledging anything
    before the kernel fails it: a link that silently drops everything ends the ring then, whatever
    ``timeout``. It is each rank's own; it need not match.
    """

    timeout: float = _setting("timeout", "ELASTIC_COLLECTIVE_TIMEOUT")          # s without progress: a hung peer
    form_timeout: float = _setting("form_timeout", "ELASTIC_FORM_TIMEOUT")      # s form() waits for its neighbours
    dead_link_timeout: float = _setting("dead_link_timeout", "ELASTIC_DEAD_LINK_TIMEOUT")  # s unacknowledged: link dead
    segment_bytes: int = _setting("segment_bytes", "ELASTIC_SEGMENT_BYTES")     # pipeline segment
    small_bytes: int = _setting("small_bytes", "ELASTIC_SMALL_BYTES")           # small-message allreduce up to this
    fusion_bytes: int = _setting("fusion_bytes", "ELASTIC_FUSION_THRESHOLD")    # async allreduce buckets up to this
    transport: str = _setting("transport", "ELASTIC_TRANSPORT")                 # "auto" or "tcp"
    algorithm: str = _setting("algorithm", "ELASTIC_ALLREDUCE_ALGORITHM")       # "auto", "ring" or "hierarchical"
    hierarchical_bytes: int = _setting("hierarchical_bytes", "ELASTIC_HIERARCHICAL_BYTES")  # "auto" above this

    def __post_init__(self):
        self.to_native()  # the core checks every value

    def to_native(self) -> Any:
        """The core's ``CommConfig`` with these values, checked (``ValueError`` names a bad one)."""
        native = _native.CommConfig()
        for field in dataclasses.fields(self):
            setattr(native, field.name, getattr(self, field.name))
        native.check()
        return native

    @staticmethod
    def env_var(name: str) -> str:
        """The environment variable of setting ``name``."""
        return next(f.metadata["env"] for f in dataclasses.fields(CommConfig) if f.name == name)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None, **overrides: Any) -> "CommConfig":
        """Reads ELASTIC_COLLECTIVE_TIMEOUT, ELASTIC_FORM_TIMEOUT, ELASTIC_DEAD_LINK_TIMEOUT, ELASTIC_SEGMENT_BYTES,
        ELASTIC_SMALL_BYTES, ELASTIC_FUSION_THRESHOLD, ELASTIC_TRANSPORT, ELASTIC_ALLREDUCE_ALGORITHM and
        ELASTIC_HIERARCHICAL_BYTES; keyword overrides win."""
        env = os.environ if env is None else env
        values: dict = {}
        for field in dataclasses.fields(cls):
            var = field.metadata["env"]
            raw = env.get(var, "")
            if raw == "":
                continue
            kind = type(field.default)
            try:
                values[field.name] = raw.strip().lower() if kind is str else kind(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a valid {kind.__name__}") from None
            try:
                cls(**{field.name: values[field.name]})  # the core checks it; say where it came from
            except ValueError as e:
                raise ValueError(f"{var}={raw!r}: {e}") from None
        values.update(overrides)
        return cls(**values)
