"""torchrun's flags on `elastic-run`'s command line: the ones that mean the same are aliases, the
others end the launcher with one line naming what to use instead (never "unrecognized arguments").

torchrun counts nodes and asks each for a rank and a rendezvous backend; elastic-run counts
workers, joins one rendezvous service and gets ranks from it, so most of torchrun's node flags
have no counterpart, only a different way to say the same thing.
"""

from __future__ import annotations

import argparse
from typing import Dict, Tuple

# elastic-run's flag -> torchrun's spellings of it (same meaning, same values).
ALIASES: Dict[str, Tuple[str, ...]] = {
    "--np": ("--nproc-per-node", "--nproc_per_node"),
    "--max-restarts": ("--max_restarts",),
}

# torchrun's flag -> what to do with elastic-run instead (one line).
INSTEAD: Dict[str, str] = {
    "--nnodes": "elastic-run counts workers, not nodes: run one elastic-run per host with the same "
                "--rendezvous and --job-id, and give the job's size in workers with --min-np/--max-np",
    "--node-rank": "ranks come from the rendezvous (they change as workers come and go): run one "
                   "elastic-run per host with a distinct --host instead",
    "--rdzv-endpoint": "use --rendezvous HOST:PORT[,HOST:PORT...] (elastic-rendezvous serve on that port)",
    "--rdzv-id": "use --job-id ID",
    "--rdzv-backend": "the rendezvous is elastic-rendezvous (etcd v3 behind it): drop the flag; "
                      "--rendezvous names its servers",
    "--rdzv-conf": "give elastic-rendezvous serve its settings (--heartbeat-timeout, --settle, ...)",
    "--standalone": "elastic-run without --rendezvous is standalone already (an embedded rendezvous "
                    "server on 127.0.0.1): drop the flag",
    "--master-addr": "there is no master: workers find each other through --rendezvous; drop the flag",
    "--master-port": "there is no master: workers find each other through --rendezvous; drop the flag",
    "--monitor-interval": "elastic-run watches its workers itself: drop the flag",
    "--role": "drop the flag: every worker of a job runs the same command",
    "--log-dir": "worker output is prefixed with its worker id on elastic-run's stdout/stderr: redirect it",
    "--redirects": "worker output is prefixed with its worker id on elastic-run's stdout/stderr: redirect it",
    "--tee": "worker output is prefixed with its worker id on elastic-run's stdout/stderr: redirect it",
}


def spellings(flag: str) -> Tuple[str, ...]:
    """torchrun accepts both `--a-b` and `--a_b`."""
    return (flag, "--" + flag[2:].replace("-", "_")) if "-" in flag[2:] else (flag,)


class _Instead(argparse.Action):
    """A torchrun flag elastic-run has no counterpart for: fails parsing with the hint."""

    def __init__(self, option_strings, dest, hint: str = "", **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kwargs)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is torchrun's flag: {self.hint}")


def add_torchrun_flags(p: argparse.ArgumentParser) -> None:
    """Registers torchrun's spellings of elastic-run's flags (hidden: errors and --help name
    elastic-run's own) and torchrun's flags that elastic-run lacks, each failing with what to
    use instead. Call it after elastic-run's own flags are defined."""
    for flag, aliases in ALIASES.items():
        own = next(a for a in p._actions if flag in a.option_strings)
        for alias in aliases:
            p.add_argument(alias, dest=own.dest, type=own.type, metavar=own.metavar,
                           default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for flag, hint in INSTEAD.items():
        p.add_argument(*spellings(flag), action=_Instead, hint=hint, dest=f"torchrun_{flag[2:]}")
