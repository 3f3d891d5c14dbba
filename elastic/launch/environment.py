"""The environment elastic-run starts each worker with: what it sets, and what a worker never inherits.

A pure function of the launch configuration and the worker's place (its slot, its incarnation,
the rendezvous addresses and credentials of the moment); the launcher calls it at every spawn.
"""

from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Sequence

from rendezvous.common.client_flags import TLS_VARIABLES
from elastic.runtime.worker_metrics import ENV_SOCKET, ENV_TOKEN
from elastic.launch.flags import LaunchConfig
from elastic.launch.gpus import gpu_env
from elastic.launch.procs import worker_env

# Replaced in every worker's environment by what credential_env gives (if anything).
CREDENTIAL_VARIABLES = ("ELASTIC_TOKEN", "ELASTIC_TOKEN_FILE", *TLS_VARIABLES)
# torchrun's variables: LOCAL_* are set for each worker; RANK and WORLD_SIZE inherited from this
# launcher's environment would be false (the runtime sets them as worlds form).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")
# Set from --min-np/--max-np only: a variable left in the launcher's environment must not pin a
# limit the flags leave to the job.
LIMIT_VARIABLES = ("ELASTIC_MIN_NP", "ELASTIC_MAX_NP", "ELASTIC_MIN_NP_IF_NEW", "ELASTIC_MAX_NP_IF_NEW")
# Never inherited: only this launcher's own --metrics-port socket (a worker of an elastic-run
# started by a worker must not push to the outer launcher).
METRICS_VARIABLES = (ENV_SOCKET, ENV_TOKEN)
# All of the above: what no process this launcher starts inherits from its own environment.
NOT_INHERITED = CREDENTIAL_VARIABLES + METRICS_VARIABLES + LIMIT_VARIABLES + TORCHRUN_VARIABLES


def spawn_env(base: Mapping[str, str], cfg: LaunchConfig, *, slot: int, incarnation: int, worker_id: str,
              addresses: Sequence[str], local_slots: int, token_file: Optional[str],
              metrics_env: Mapping[str, str]) -> Dict[str, str]:
    """The environment of incarnation ``incarnation`` of the worker in ``slot``: ``base`` (the
    launcher's own) without what a worker must not inherit, with the job's variables on top."""
    return worker_env(base, {
        "ELASTIC_RENDEZVOUS": ",".join(addresses), "ELASTIC_JOB_ID": cfg.job_id,
        "ELASTIC_WORKER_ID": worker_id, "ELASTIC_HOST": cfg.host,
        **limits_env(cfg),
        **({"ELASTIC_COLLECTIVE_TIMEOUT": f"{cfg.collective_timeout:g}"} if cfg.collective_timeout else {}),
        **torchrun_env(cfg, slot, local_slots), **gpu_env(cfg.gpus, slot), "ELASTIC_LOG_LEVEL": cfg.log_level,
        **cfg.stragglers.to_env(),
        "ELASTIC_ELASTIC_TIMEOUT": f"{cfg.elastic_timeout:g}", "ELASTIC_PREEMPT_GRACE": f"{cfg.preempt_grace:g}",
        "ELASTIC_LOCAL_SLOT": str(slot), "ELASTIC_RESTART_COUNT": str(incarnation), **credential_env(cfg, token_file),
        **metrics_env,
    }, drop=NOT_INHERITED)


def fork_server_env(base: Mapping[str, str], cfg: LaunchConfig) -> Dict[str, str]:
    """The environment --preload's fork server imports its modules in: what every worker of this
    launcher shares (OMP_NUM_THREADS and the defaults of procs.WORKER_DEFAULTS), none of what
    differs per worker or grants access (ids, ranks, credentials): each forked worker then gets
    its own ``spawn_env`` in full."""
    return worker_env(base, {"OMP_NUM_THREADS": cfg.omp_num_threads} if cfg.omp_num_threads is not None else {},
                      drop=NOT_INHERITED)


def torchrun_env(cfg: LaunchConfig, slot: int, local_slots: int) -> Dict[str, str]:
    """The variables torchrun sets that stay true across re-forms: LOCAL_RANK is the worker's
    slot on this host (0..slots-1, its own for the process's life and its respawns': what
    device selection needs; with --gpus-per-host the worker sees its one GPU only, and
    ``gpu_env`` makes it 0, that GPU's index), LOCAL_WORLD_SIZE the slots of this host; OMP_NUM_THREADS=1
    unless the environment has one, as torchrun. RANK and WORLD_SIZE change with every
    world: the runtime sets them in the worker's own environment as each world forms
    (elastic.runtime.world_env); MASTER_ADDR/MASTER_PORT are not set: there is no master."""
    env = {"LOCAL_RANK": str(slot), "LOCAL_WORLD_SIZE": str(max(local_slots, slot + 1))}
    if cfg.omp_num_threads is not None:
        env["OMP_NUM_THREADS"] = cfg.omp_num_threads
    return env


def limits_env(cfg: LaunchConfig) -> Dict[str, str]:
    """The job size limits its workers join with: the --min-np/--max-np given, as limits they
    insist on; the others left to the job (whenever its workers join: a job another launcher
    created meanwhile keeps its own), with this launcher's defaults (--min-np = --np) for a
    job its worker's join creates."""
    env = {"ELASTIC_MIN_NP_IF_NEW": str(cfg.min_np), "ELASTIC_MAX_NP_IF_NEW": str(cfg.max_np)}
    if cfg.min_np_given:
        env["ELASTIC_MIN_NP"] = str(cfg.min_np)
    if cfg.max_np_given:
        env["ELASTIC_MAX_NP"] = str(cfg.max_np)
    return env


def credential_env(cfg: LaunchConfig, token_file: Optional[str]) -> Dict[str, str]:
    """How workers authenticate, in place of those variables in the launcher's environment:
    the embedded server's token file, else --token-file, else the inherited ELASTIC_TOKEN /
    ELASTIC_TOKEN_FILE; the TLS files this launcher uses itself (none for the embedded server)."""
    if token_file:
        env = {"ELASTIC_TOKEN_FILE": os.path.abspath(token_file)}
    else:
        env = dict(cfg.inherited_token_env)
    for name, path in zip(TLS_VARIABLES, (cfg.tls_ca, cfg.tls_cert, cfg.tls_key)):
        if path:
            env[name] = path
    return env
