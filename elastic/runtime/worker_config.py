"""Worker configuration: the one place the runtime reads the environment the launcher sets.

This is the one table of a worker's environment (docs/reference/environment.md is generated from it).
"default" is what a worker started by hand gets; "elastic-run" is what the launcher sets.

| variable | meaning | default | elastic-run |
| --- | --- | --- | --- |
| ``ELASTIC_RENDEZVOUS`` | rendezvous server(s), ``HOST:PORT[,HOST:PORT…]`` | required for ``init()`` | its embedded server, or ``--rendezvous`` |
| ``ELASTIC_JOB_ID`` | job id (``[A-Za-z0-9._-]``, 1-128 chars) | ``default`` | ``--job-id`` |
| ``ELASTIC_WORKER_ID`` | unique worker id within the job | ``HOST-PID`` | ``HOST-SLOT``, ``HOST-SLOT-rN`` after respawns |
| ``ELASTIC_HOST`` | host name; ranks of one host are contiguous | ``socket.gethostname()`` | ``--host`` |
| ``ELASTIC_RING_HOST`` | address this worker's ring listener binds and announces | ``127.0.0.1`` if the rendezvous is on loopback, else the host's address (which must then not be loopback: a loopback one stops the worker) | inherited |
| ``ELASTIC_TOKEN_FILE`` / ``ELASTIC_TOKEN`` | rendezvous token (gRPC metadata) | none (insecure server) | ``--token-file``; the embedded server's private token file |
| ``ELASTIC_TLS_CA`` | connect to the rendezvous with TLS, trusting this CA (PEM) | plaintext | ``--tls-ca`` |
| ``ELASTIC_TLS_CERT`` / ``ELASTIC_TLS_KEY`` | client certificate and key (servers with ``--tls-client-ca``) | none | ``--tls-cert`` / ``--tls-key`` |
| ``ELASTIC_MIN_NP`` / ``ELASTIC_MAX_NP`` | job size limits this worker insists on: a running job with others refuses it | unset: the job's, whenever it joins | ``--min-np`` / ``--max-np`` when given |
| ``ELASTIC_MIN_NP_IF_NEW`` / ``ELASTIC_MAX_NP_IF_NEW`` | the limits of a job this worker's join creates, where the two above are unset | 1 / 1024 | ``--min-np`` (= ``--np``) / ``--max-np`` (1024) |
| ``ELASTIC_ELASTIC_TIMEOUT`` | seconds the job may stay below min-np | the server's (600) | ``--elastic-timeout`` (600) |
| ``ELASTIC_WORLD_TIMEOUT`` | seconds to wait for a world that includes this worker | 600 | inherited |
| ``ELASTIC_FORM_TIMEOUT`` | seconds a ring may take to form (the rendezvous aborts it sooner when a peer fails) | ``ELASTIC_WORLD_TIMEOUT`` | inherited |
| ``ELASTIC_COLLECTIVE_TIMEOUT`` | seconds a worker may stay in one collective before it fails and the world re-forms (docs: "The collective timeout") | 1800 | ``--collective-timeout`` |
| ``ELASTIC_AFTER_RUN_TIMEOUT`` | seconds each member of the ring kept after the run (``dist.barrier()``, a last allreduce after ``elastic.run`` returned) may take to enter a collective its ring neighbour entered; one that does not is named and every member's collective fails (``elastic.ring.arrival``). Set it above the longest work one rank does alone after the run (rank 0 saving the model before a barrier) | 300, at most ``ELASTIC_COLLECTIVE_TIMEOUT`` | inherited |
| ``ELASTIC_RESET_LIMIT`` | re-forms after which ``elastic.run`` gives up (0: no limit) | 0 | inherited |
| ``ELASTIC_DEFAULT_GROUP`` | ``0`` (``false``, ``no``, ``off``): ``elastic.run`` leaves torch.distributed's default group unset (``elastic.process_group()`` still works) | ``1`` | inherited |
| ``ELASTIC_COMMIT_WARN_STEPS`` / ``ELASTIC_COMMIT_WARN_SECONDS`` | warn once (rank 0) when training goes this many steps or seconds without a ``state.commit()``; 0: never (``elastic.runtime.commit_watch``) | 1000 / 600 | inherited |
| ``ELASTIC_PREEMPT_GRACE`` | seconds a worker asked to leave (SIGTERM, SIGINT, ``elastic.request_leave()``) may take to reach a commit boundary; then it ends as a failure | 30 | ``--preempt-grace`` |
| ``ELASTIC_STRAGGLER_POLICY``, ``ELASTIC_STRAGGLER_FACTOR``, ``ELASTIC_STRAGGLER_WINDOWS``, ``ELASTIC_STRAGGLER_WINDOW`` | straggler detection: what happens to a straggler (``report``, ``evict``, ``off``), how many times the median compute time is slow, how many slow windows in a row name it, the shortest window in seconds (``elastic.runtime.straggler_detector.StragglerConfig``) | ``report``, 1.5, 3, 1 | ``--straggler-policy``, ``--straggler-factor``, ``--straggler-windows``, ``--straggler-window`` |
| ``ELASTIC_LOG_LEVEL`` | log the runtime's lines (rank of each world, standby, recoveries) on stderr at this level, unless the script configured logging itself (``elastic.runtime.logs``) | unset: Python's defaults | ``--log-level`` (``info``; ``--quiet``: ``warning``) |
| ``ELASTIC_METRICS_SOCKET`` / ``ELASTIC_METRICS_TOKEN`` | where to push this worker's metrics, and its token (``elastic.runtime.worker_metrics``) | no metrics | ``--metrics-port`` sets both |
| ``ELASTIC_DEAD_LINK_TIMEOUT`` | seconds a ring connection may go without the peer's kernel acknowledging anything before it fails (a link dropping everything, no reset); 2 to 86400 | 30 | inherited |
| ``ELASTIC_TRANSPORT`` | ``auto``: shared memory between ring neighbours on the same host, TCP otherwise; ``tcp``: TCP only (``elastic.CommConfig``) | ``auto`` | inherited |
| ``ELASTIC_ALLREDUCE_ALGORITHM``, ``ELASTIC_HIERARCHICAL_BYTES`` | ``auto``: hierarchical (per host, then across hosts) in mixed worlds above the byte threshold, the ring otherwise; ``ring``; ``hierarchical``. Ring settings must be the same on every worker (checked when a ring forms) | ``auto``, 4 MiB | inherited |
| ``ELASTIC_SEGMENT_BYTES``, ``ELASTIC_SMALL_BYTES``, ``ELASTIC_FUSION_THRESHOLD`` | ring pipeline segment, small-message cut-off, async fusion bucket | 1 MiB, 32 KiB, 64 MiB | inherited |
| ``ELASTIC_DEVICE_BACKEND`` | the communicator each world makes for device tensors (``elastic.torchdist.device_backend``): ``auto`` (``nccl`` where CUDA is available, else none), ``nccl``, ``gloo`` (a stand-in on the CPU, for tests: the elastic group's CPU tensors then run on it), ``off``. Must be the same on every worker (checked as each world forms) | ``auto`` | inherited |
| ``ELASTIC_DEVICE_ABORT_TIMEOUT`` | seconds an abort of a world's device communicator may take; past it the worker exits with status ``DEVICE_ABORT_STUCK_EXIT`` (75) and elastic-run respawns it | 10 | inherited |
| ``ELASTIC_LOCAL_SLOT`` | the worker's slot on its host, stable across respawns (read by scripts, not here) | unset | the slot |
| ``ELASTIC_RESTART_COUNT`` | times this slot was started before (read by scripts, not here) | unset | the count |

elastic-run also sets torchrun's ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``OMP_NUM_THREADS``
(docs: "From torchrun: DDP"), ``CUDA_VISIBLE_DEVICES`` with ``--gpus-per-host`` (the worker's one
GPU; docs: "Train on GPUs"), and, unless they are set already, ``PYTHONUNBUFFERED=1``,
``GRPC_VERBOSITY=ERROR`` and ``GRPC_ENABLE_FORK_SUPPORT=0`` (``elastic.launch.environment``).

The ring secret is not configured: the rendezvous server makes a random one per job and hands it
to each worker it admits (``RendezvousClient.ring_secret``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Callable, Mapping, Optional, Sequence, Tuple

from rendezvous.common import client_flags
from rendezvous.common.channel import channel_credentials, is_loopback, parse_addresses, read_token_file
from rendezvous.wire.membership import DEFAULT_MAX_NP

from elastic.runtime import worker_metrics as metrics
from elastic.runtime.commit_watch import DEFAULT_MAX_SECONDS, DEFAULT_MAX_STEPS
from elastic.ring.communicator import CommConfig
from elastic.runtime.straggler_detector import StragglerConfig

TLS_VARIABLES = client_flags.TLS_VARIABLES   # defined once, with the flags that set them

# The status a worker exits with when the abort of its device communicator does not return
# within ELASTIC_DEVICE_ABORT_TIMEOUT (EX_TEMPFAIL: try again). elastic-run respawns it, as a
# worker killed by a signal: the process is wedged, the job is not.
DEVICE_ABORT_STUCK_EXIT = 75
DEVICE_BACKENDS = ("auto", "nccl", "gloo", "off")


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    rendezvous: Tuple[str, ...]
    job_id: str = "default"
    worker_id: str = ""
    host: str = ""
    ring_host: str = "127.0.0.1"
    token: Optional[str] = None
    tls_ca: Optional[str] = None            # PEM paths; no CA: plaintext to the rendezvous
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    min_np: int = 0                         # 0: none of its own, the job's (see rendezvous.server.decision.join_spec)
    max_np: int = 0
    min_np_if_new: int = 1                  # the limits of a job this worker's join creates, where
    max_np_if_new: int = DEFAULT_MAX_NP     # min_np / max_np leave them to the job
    elastic_timeout: float = 0.0
    world_timeout: float = 600.0
    reset_limit: int = 0
    preempt_grace: float = 30.0
    commit_warn_steps: int = DEFAULT_MAX_STEPS       # ELASTIC_COMMIT_WARN_STEPS (0: never)
    commit_warn_seconds: float = DEFAULT_MAX_SECONDS  # ELASTIC_COMMIT_WARN_SECONDS (0: never)
    log_level: Optional[str] = None         # ELASTIC_LOG_LEVEL: install the "elastic" log handler (elastic.runtime.logs)
    metrics_socket: Optional[str] = None    # elastic-run --metrics-port: push metrics there
    metrics_token: Optional[str] = dataclasses.field(default=None, repr=False)
    default_group: bool = True              # ELASTIC_DEFAULT_GROUP: elastic.run makes the elastic group torch's default
    device_backend: str = "auto"            # ELASTIC_DEVICE_BACKEND: each world's communicator for device tensors
    device_abort_timeout: float = 10.0      # ELASTIC_DEVICE_ABORT_TIMEOUT: past it, exit DEVICE_ABORT_STUCK_EXIT
    after_run_timeout: float = 300.0       # ELASTIC_AFTER_RUN_TIMEOUT: each collective's arrival bound on the kept ring
    comm: CommConfig = dataclasses.field(default_factory=CommConfig)
    stragglers: StragglerConfig = dataclasses.field(default_factory=StragglerConfig)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "WorkerConfig":
        env = os.environ if env is None else env
        addresses = env.get("ELASTIC_RENDEZVOUS", "")
        if not addresses:
            raise ValueError("ELASTIC_RENDEZVOUS is not set: start workers with elastic-run, or set it to the "
                             "rendezvous server's HOST:PORT")
        rendezvous = parse_addresses(addresses, "ELASTIC_RENDEZVOUS")
        host = env.get("ELASTIC_HOST") or socket.gethostname()
        job_id = env.get("ELASTIC_JOB_ID", "default")
        token = env.get("ELASTIC_TOKEN") or None
        token_file = env.get("ELASTIC_TOKEN_FILE")
        if token is None and token_file:
            token = read_token_file(token_file, "ELASTIC_TOKEN_FILE")
        tls_ca, tls_cert, tls_key = (env.get(name) or None for name in TLS_VARIABLES)
        channel_credentials(tls_ca, tls_cert, tls_key, names=TLS_VARIABLES)  # unreadable: fail now
        metrics_socket, metrics_token = metrics.config_from_env(env)
        ring_host = ring_host_for(env.get("ELASTIC_RING_HOST", ""), rendezvous, _host_address)

        def number(name: str, kind, default):
            raw = env.get(name, "")
            if raw == "":
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
            if value < 0:
                raise ValueError(f"{name}={raw!r} must not be negative")
            return value

        cfg = cls(
            rendezvous=rendezvous,
            job_id=job_id,
            worker_id=env.get("ELASTIC_WORKER_ID") or f"{host}-{os.getpid()}",
            host=host,
            ring_host=ring_host,
            token=token,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            min_np=number("ELASTIC_MIN_NP", int, 0),
            max_np=number("ELASTIC_MAX_NP", int, 0),
            min_np_if_new=number("ELASTIC_MIN_NP_IF_NEW", int, 1),
            max_np_if_new=number("ELASTIC_MAX_NP_IF_NEW", int, DEFAULT_MAX_NP),
            elastic_timeout=number("ELASTIC_ELASTIC_TIMEOUT", float, 0.0),
            world_timeout=number("ELASTIC_WORLD_TIMEOUT", float, 600.0),
            reset_limit=number("ELASTIC_RESET_LIMIT", int, 0),
            preempt_grace=number("ELASTIC_PREEMPT_GRACE", float, 30.0),
            commit_warn_steps=number("ELASTIC_COMMIT_WARN_STEPS", int, DEFAULT_MAX_STEPS),
            commit_warn_seconds=number("ELASTIC_COMMIT_WARN_SECONDS", float, DEFAULT_MAX_SECONDS),
            log_level=_log_level(env.get("ELASTIC_LOG_LEVEL", "")),
            metrics_socket=metrics_socket,
            metrics_token=metrics_token,
            default_group=default_group_from_env(env),
            device_backend=_device_backend(env.get("ELASTIC_DEVICE_BACKEND", "")),
            device_abort_timeout=number("ELASTIC_DEVICE_ABORT_TIMEOUT", float, 10.0),
            after_run_timeout=number("ELASTIC_AFTER_RUN_TIMEOUT", float, 300.0),
            comm=CommConfig.from_env(env),
            stragglers=StragglerConfig.from_env(env),
        )
        if env.get("ELASTIC_FORM_TIMEOUT", "") == "":
            # Forming is aborted by the rendezvous when a peer dies or the world is superseded,
            # so its own deadline is only a backstop; a newcomer may wait for the old members'
            # next commit, which can be far longer than the ring default.
            cfg = dataclasses.replace(cfg, comm=dataclasses.replace(cfg.comm, form_timeout=cfg.world_timeout))
        if not cfg.device_abort_timeout > 0:
            raise ValueError(f"ELASTIC_DEVICE_ABORT_TIMEOUT={cfg.device_abort_timeout:g} must be positive (seconds)")
        if not cfg.after_run_timeout > 0:
            raise ValueError(f"ELASTIC_AFTER_RUN_TIMEOUT={cfg.after_run_timeout:g} must be positive (seconds)")
        if not cfg.preempt_grace > 0:
            raise ValueError(f"ELASTIC_PREEMPT_GRACE={cfg.preempt_grace:g} must be positive (seconds)")
        check_limits(cfg)
        return cfg

    def channel_credentials(self):
        """TLS credentials for the rendezvous channel (None: plaintext)."""
        return channel_credentials(self.tls_ca, self.tls_cert, self.tls_key, names=TLS_VARIABLES)


DEFAULT_GROUP_ENV = "ELASTIC_DEFAULT_GROUP"


def default_group_from_env(env: Optional[Mapping[str, str]] = None) -> bool:
    """ELASTIC_DEFAULT_GROUP: ``0``, ``false``, ``no`` or ``off`` keep ``elastic.run`` from making
    the elastic group torch.distributed's default group; anything else, or unset, lets it. Read
    here for ``WorkerConfig`` and for ``elastic.torchdist.group.install_default_group`` called outside a session."""
    env = os.environ if env is None else env
    return env.get(DEFAULT_GROUP_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _device_backend(raw: str) -> str:
    kind = raw.strip().lower() or "auto"
    if kind not in DEVICE_BACKENDS:
        raise ValueError(f"ELASTIC_DEVICE_BACKEND={raw!r}: use {', '.join(DEVICE_BACKENDS)}")
    return kind


def _log_level(raw: str) -> Optional[str]:
    level = raw.strip().upper()
    if not level:
        return None
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(f"ELASTIC_LOG_LEVEL={raw!r}: use debug, info, warning or error")
    return level


def check_limits(cfg: WorkerConfig) -> None:
    """The size limits can hold: those given (ELASTIC_MIN_NP, ELASTIC_MAX_NP; unset is the job's)
    and, should this worker create the job, the ones it would create it with."""
    if cfg.min_np and cfg.max_np and cfg.max_np < cfg.min_np:
        raise ValueError(f"need ELASTIC_MIN_NP <= ELASTIC_MAX_NP, got {cfg.min_np} and {cfg.max_np}")
    lo, hi = cfg.min_np or cfg.min_np_if_new, cfg.max_np or cfg.max_np_if_new
    if lo < 1 or hi < lo:
        raise ValueError(f"need 1 <= min-np <= max-np for a job this worker creates, got {lo} and {hi} "
                         "(ELASTIC_MIN_NP or ELASTIC_MIN_NP_IF_NEW, ELASTIC_MAX_NP or ELASTIC_MAX_NP_IF_NEW)")


def ring_host_for(explicit: str, rendezvous: Sequence[str], resolve: Callable[[], Tuple[str, str]]) -> str:
    """The address this worker's ring listener binds and announces (a pure decision).

    ``explicit`` is ELASTIC_RING_HOST (always wins, even a loopback one: the operator said so);
    ``rendezvous`` the server addresses; ``resolve()`` gives (host name, address it resolves
    to, "" if it does not). With every rendezvous address on loopback the job is on this host:
    127.0.0.1. Otherwise the job may span hosts, and the host's own address is announced;
    a loopback one (Debian's /etc/hosts maps the host name to 127.0.1.1) would leave the
    other hosts' workers connecting to themselves until the form timeout, so that stops
    the worker at start, naming ELASTIC_RING_HOST.
    """
    if explicit:
        return explicit
    if all(is_loopback(a.rpartition(":")[0]) for a in rendezvous):
        return "127.0.0.1"
    name, address = resolve()
    if address and not is_loopback(address):
        return address
    found = f"resolves to {address}, a loopback address" if address else "does not resolve"
    raise ValueError(f"ELASTIC_RING_HOST is not set and this host's name {name!r} {found}, which workers on other "
                     f"hosts cannot reach; the rendezvous ({','.join(rendezvous)}) is not on loopback, so the job "
                     "may span hosts: set ELASTIC_RING_HOST to this host's address on the network the workers "
                     "share (or to 127.0.0.1 if every worker runs on this host)")


def _host_address() -> Tuple[str, str]:
    """This host's name and the address it resolves to ("" if it does not)."""
    name = socket.gethostname()
    try:
        return name, socket.gethostbyname(name)
    except OSError:
        return name, ""
