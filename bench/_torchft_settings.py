"""TorchFT's settings in bench/goodput.py, by name: those of TorchFT's own example, and the library's defaults.

Where each comes from (pytorch/torchft at 73dafea, 2025-10-21; the torchft-nightly 2026.10.26
wheel pinned in pyproject.toml has the same signatures and CLI defaults):

  example   train_ddp.py, its CPU path (TorchFT's DDP example):
              ProcessGroupGloo(timeout=timedelta(seconds=5))                   train_ddp.py:90
              PGTransport(pg, timeout=timedelta(seconds=10), device="cpu")     train_ddp.py:92-102
              Manager(pg=pg, ..., timeout=timedelta(seconds=30),               train_ddp.py:104-112
                      checkpoint_transport=transport)
            (quorum_timeout and connect_timeout are not set there: 60 s, the library's; on
            CUDA the example gives ProcessGroupNCCL 30 s instead, train_ddp.py:84).
  defaults  what a Manager gets when nothing is set (torchft/manager.py, Manager.__init__:
            timeout, quorum_timeout and connect_timeout 60 s, the checkpoint sent over HTTP by
            HTTPTransport(timeout=timeout); torchft/process_group.py, ProcessGroupWrapper:
            a ProcessGroupGloo's timeout 60 s). bench/goodput.py ran only this until TorchFT's
            example settings were added.

The lighthouse is the same for both: README.md's "Lighthouse" section (lines 175-184) starts it as
``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``; the bench
passes those two timings, leaves the heartbeat timeout at its default (5000 ms,
``torchft_lighthouse --help``), and sets min_replicas (and each Manager's min_replica_size) to 2,
as elastic-run runs with --min-np 2: both go on with 2 or more of the 4 workers. The CLI's own default join timeout is 60000 ms; TorchFT's README lowers it,
and so does the bench in both settings.

Nothing here imports torch: bench/goodput.py reads it to print the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

SOURCE = "pytorch/torchft@73dafea"
QUORUM_TICK_MS = 100         # README.md, Lighthouse (also the CLI's default)
JOIN_TIMEOUT_MS = 10000      # README.md, Lighthouse (the CLI's default: 60000)
HEARTBEAT_TIMEOUT_MS = 5000  # not set: the lighthouse's default (torchft_lighthouse --help)


@dataclass(frozen=True)
class Settings:
    """One way to configure a replica group's process group and Manager. ``None``: not passed,
    the library's default applies."""
    name: str
    title: str                            # the table's column
    pg_timeout_s: Optional[float]         # ProcessGroupGloo(timeout=...)
    manager_timeout_s: Optional[float]    # Manager(timeout=...): collectives, should_commit, recovery
    transport_timeout_s: Optional[float]  # PGTransport(pg, timeout=...) as the Manager's checkpoint_transport
    source: str


EXAMPLE = Settings("example", "TorchFT, example settings", 5.0, 30.0, 10.0,
                   f"{SOURCE} train_ddp.py (CPU path)")
DEFAULTS = Settings("defaults", "TorchFT, library defaults", None, None, None,
                    f"{SOURCE} torchft/manager.py Manager.__init__, torchft/process_group.py ProcessGroupWrapper")
SETTINGS = {s.name: s for s in (EXAMPLE, DEFAULTS)}


def lighthouse_line(min_replicas: int) -> str:
    return (f"LighthouseServer(bind=\"[::]:0\", min_replicas={min_replicas}, quorum_tick_ms={QUORUM_TICK_MS}, "
            f"join_timeout_ms={JOIN_TIMEOUT_MS}), as `torchft_lighthouse --min_replicas {min_replicas} "
            f"--quorum_tick_ms {QUORUM_TICK_MS} --join_timeout_ms {JOIN_TIMEOUT_MS}`; heartbeat_timeout_ms not set "
            f"({HEARTBEAT_TIMEOUT_MS} by default) [{SOURCE} README.md, Lighthouse]")


def describe(settings: Settings, min_replicas: int) -> List[str]:
    """The constructor calls one replica group makes under ``settings``, what they leave at the
    library's defaults, and where the settings come from."""

    def seconds(value: float) -> str:
        return f"timedelta(seconds={value:g})"

    pg = f"ProcessGroupGloo(timeout={seconds(settings.pg_timeout_s)})" if settings.pg_timeout_s else "ProcessGroupGloo()"
    manager = [f"min_replica_size={min_replicas}"]
    unset = ["quorum_timeout (60 s)", "connect_timeout (60 s)"]
    if settings.manager_timeout_s:
        manager.append(f"timeout={seconds(settings.manager_timeout_s)}")
    else:
        unset.append("timeout (60 s)")
    if settings.transport_timeout_s:
        manager.append(f"checkpoint_transport=PGTransport(pg, timeout={seconds(settings.transport_timeout_s)}, "
                       "device=\"cpu\")")
    else:
        unset.append("checkpoint_transport (HTTPTransport, timeout 60 s)")
    if not settings.pg_timeout_s:
        unset.insert(0, "the gloo timeout (60 s)")
    return [f"pg = {pg}",
            f"Manager(pg, {', '.join(manager)}, use_async_quorum=True, rank=0, world_size=1, ...)",
            f"not set (library defaults): {', '.join(unset)}",
            f"source: {settings.source}"]
