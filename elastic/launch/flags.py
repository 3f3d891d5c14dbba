"""`elastic-run` flags: the argument parser, its help text, and the one dataclass they fill.

Everything the launcher decides from the command line and its environment (the token and TLS
files it falls back to) is read once, here, into ``LaunchConfig``, and passed down; bad input
raises ``UsageError`` with a one-line message (printed without a traceback by ``elastic.launch``).
HOST:PORT lists and token files are read by the same functions every client of the service uses
(rendezvous.common.channel).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import socket
import sys
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

from rendezvous import __version__
from rendezvous.common import files
from rendezvous.common.channel import channel_credentials, parse_addresses, read_token_file
from rendezvous.common.client_flags import TLS_FLAGS, TLS_VARIABLES, TOKEN_FILE, TOKEN_VARIABLE, add_client_flags
from rendezvous.wire.membership import DEFAULT_MAX_NP
from rendezvous.common.ports import check_can_listen

from elastic.ring.communicator import CommConfig
from elastic.runtime.worker_config import _host_address as host_address
from elastic.runtime.straggler_detector import POLICIES, StragglerConfig
from elastic.launch.embedded import EMBEDDED_HOST
from elastic.launch.forkserver import forkable
from elastic.launch.gpus import placement, visible_gpus
from elastic.launch.slurm import (SlurmEnvError, SlurmStep, announcement_dir, check_base_dir, from_slurm_env,
                                  serve_host)
from elastic.launch.torchrun_flags import add_torchrun_flags

ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")

DESCRIPTION = """\
Start the workers of an elastic-ring training job on this host and keep them going.

  elastic-run --np 4 -- python examples/train_linear.py            # one machine, embedded rendezvous
  elastic-run --np 4 --min-np 2 --max-restarts 3 -- python train.py --lr 0.1
  elastic-run --np 8 --rendezvous 10.0.0.1:29400,10.0.0.2:29400 --job-id exp7 -- python train.py

Without --rendezvous, an embedded rendezvous server (in-memory store, bound to 127.0.0.1, with a
random token that only this launcher's workers get, in a file only this user can read) runs as a
child of this launcher and stops with it. With --rendezvous, the workers
join job --job-id on those servers: run one elastic-run per host (torchrun style) to span
hosts, or to add a host to a running job. Dead workers (killed by a signal) are respawned with
backoff, at most --max-restarts times per slot; a worker that exits with an error ends the job.
Exit status: 0 when the job completed and every worker this launcher started exited 0 (a worker
killed by a signal while the job ran counts as a recovered failure); 1 with a one-line reason
when the job failed or a worker failed after it completed (each such worker is named);
2 for bad flags; 3 when the job failed because its world stayed below --min-np for
--elastic-timeout (a batch script may requeue it); 128+N when stopped by signal N. A worker that
exits 0 while the job runs has left it (preempted: SIGTERM, elastic.request_leave()): it is
reported, not respawned, and counts as a success. On SIGTERM/SIGINT this launcher drains its
workers the same way (SIGTERM to each, SIGKILL after --preempt-grace plus --stop-timeout) and
exits 0 when every one left gracefully and the job goes on elsewhere (with --rendezvous); so does
a slot the discovery script takes away.

Under Slurm (inside `srun --ntasks-per-node=1 elastic-run ...`: SLURM_JOB_ID and SLURM_STEP_ID
set) the job id defaults to SLURM_JOB_ID, the host to SLURMD_NODENAME, --np to the GPUs Slurm gives
the node (SLURM_GPUS_ON_NODE) else SLURM_NTASKS_PER_NODE, and --min-np to --np times the step's
nodes. Without --rendezvous, the elastic-run of the job's first node (the batch host) runs
the embedded server on its cluster address (ELASTIC_RING_HOST, else its host name's) and announces
it, with its token, in --rendezvous-dir; the other nodes join it. The batch host is then a single
point of failure, as for the batch script itself: give --rendezvous (elastic-rendezvous serve
replicas over etcd) for jobs that must outlive any node.
"""

EPILOG = """\
environment given to every worker (on top of this launcher's own, which is inherited):
  ELASTIC_RENDEZVOUS       rendezvous server(s), HOST:PORT[,HOST:PORT...]
  ELASTIC_JOB_ID           the job id (--job-id)
  ELASTIC_WORKER_ID        unique worker id: HOST-SLOT, HOST-SLOT-rN after the N-th respawn
  ELASTIC_HOST             this host's name (--host); ranks of one host are contiguous
  ELASTIC_MIN_NP           --min-np, when given (a running job with another one refuses the worker)
  ELASTIC_MAX_NP           --max-np, when given; without them the workers take the job's limits
  ELASTIC_MIN_NP_IF_NEW    --min-np (default --np) and --max-np (default 1024): the limits of the job
  ELASTIC_MAX_NP_IF_NEW    if a worker's join creates it (the first join of a job fixes them)
  ELASTIC_ELASTIC_TIMEOUT  --elastic-timeout: seconds the job may stay below min-np
  ELASTIC_PREEMPT_GRACE    --preempt-grace: seconds a worker told to leave may take to reach a commit
  ELASTIC_TOKEN_FILE       --token-file, or the embedded server's random token (a 0600 file)
  ELASTIC_TLS_CA           --tls-ca, when given (also ELASTIC_TLS_CERT, ELASTIC_TLS_KEY)
  ELASTIC_LOCAL_SLOT       this worker's slot on this host (0..np-1); stable across respawns
  ELASTIC_RESTART_COUNT    how many times this slot was started before (0 the first time)
  ELASTIC_METRICS_SOCKET   with --metrics-port: the Unix socket (in a 0700 directory) it pushes
                           its metrics to; ELASTIC_METRICS_TOKEN its own random token (never inherited)
  ELASTIC_LOG_LEVEL        --log-level (--quiet: warning): the runtime logs its lines at this level
  ELASTIC_COLLECTIVE_TIMEOUT  --collective-timeout, when given
  ELASTIC_STRAGGLER_POLICY, ELASTIC_STRAGGLER_FACTOR, ELASTIC_STRAGGLER_WINDOWS, ELASTIC_STRAGGLER_WINDOW
                           --straggler-policy, --straggler-factor, --straggler-windows, --straggler-window
  LOCAL_RANK               torchrun's: the worker's slot on this host (stable across respawns)
  LOCAL_WORLD_SIZE         torchrun's: the slots of this host. RANK and WORLD_SIZE change with every
                           world: the runtime sets them in the worker's environment as each forms
  OMP_NUM_THREADS=1        as torchrun, unless set already or --np is 1
  PYTHONUNBUFFERED=1       so output reaches the launcher line by line (unless set)
  GRPC_VERBOSITY=ERROR, GRPC_ENABLE_FORK_SUPPORT=0   unless set: none of gRPC's own INFO lines
Variables already set pass through, e.g. ELASTIC_RING_HOST (the address the ring listens on),
ELASTIC_COLLECTIVE_TIMEOUT, ELASTIC_WORLD_TIMEOUT, ELASTIC_RESET_LIMIT; ELASTIC_TOKEN and
ELASTIC_TOKEN_FILE too, unless --token-file or the embedded server gives the token. With
--rendezvous, ELASTIC_TLS_CA/CERT/KEY already set stand for absent --tls-* flags; for the
embedded server they are dropped.

output: every worker line is prefixed with the worker's id, "[HOST-SLOT] ..." ("[HOST-SLOT-rN]"
after a respawn), for the worker's whole life: unlike its rank, the id does not change with the
world, and lines printed before the first world or after the job ended carry it too. Launcher
lines start with "elastic-run:" and report worlds, failures and recoveries with durations.
"""


class UsageError(ValueError):
    """A bad flag or flag combination; the message is one line."""


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    command: Tuple[str, ...]
    np: int
    min_np: int
    max_np: int
    min_np_given: bool
    max_np_given: bool
    max_restarts: int
    elastic_timeout: float
    port: int
    rendezvous: Tuple[str, ...]       # empty: start the embedded server
    job_id: str
    host: str
    host_discovery_script: Optional[str]
    discovery_interval: float
    token_file: Optional[str]
    tls_ca: Optional[str]             # absolute PEM paths, for the launcher and its workers
    tls_cert: Optional[str]
    tls_key: Optional[str]
    stop_timeout: float
    connect_timeout: float
    preempt_grace: float
    collective_timeout: Optional[float] = None   # ELASTIC_COLLECTIVE_TIMEOUT for the workers (None: theirs)
    log_level: str = "INFO"                 # ELASTIC_LOG_LEVEL for the workers; above INFO: a quiet launcher
    omp_num_threads: Optional[str] = "1"    # OMP_NUM_THREADS for the workers (None: the environment's)
    metrics_port: Optional[int] = None      # serve the workers' metrics on /metrics of this port (0: a free one)
    metrics_host: str = "127.0.0.1"
    events: Optional[str] = None            # append one JSON line per launcher event to this file
    stragglers: StragglerConfig = StragglerConfig()   # --straggler-*: ELASTIC_STRAGGLER_* for the workers
    embedded_host: str = EMBEDDED_HOST      # where the embedded server listens
    preload: Tuple[str, ...] = ()           # --preload: modules the fork server imports once (forkserver.py)
    gpus: Tuple[str, ...] = ()              # --gpus-per-host: slot s's GPU is gpus[s] (elastic/launch/gpus.py); (): none
    # Under srun (elastic/launch/slurm.py): this launcher's place in the Slurm job; with
    # announce_dir, the directory where the batch host's launcher announces its embedded server
    # (slurm_role "head") and the other nodes' launchers find it ("member").
    slurm: Optional[SlurmStep] = None
    slurm_role: str = ""                    # "", "head" or "member"
    announce_dir: Optional[str] = None
    # The token this launcher sends to --rendezvous servers (--token-file, else ELASTIC_TOKEN, else
    # ELASTIC_TOKEN_FILE, as the workers read them); None with the embedded server, which makes its own.
    token: Optional[str] = dataclasses.field(default=None, repr=False)
    # ELASTIC_TOKEN / ELASTIC_TOKEN_FILE as this launcher found them: what its workers inherit
    # when neither --token-file nor the embedded server gives them one.
    inherited_token_env: Tuple[Tuple[str, str], ...] = dataclasses.field(default=(), repr=False)

    @property
    def embedded(self) -> bool:
        """This launcher runs the job's rendezvous server."""
        return not self.rendezvous and self.slurm_role != "member"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2, no usage dump
        raise UsageError(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="elastic-run", description=DESCRIPTION, epilog=EPILOG,
                usage="elastic-run --np N [options] -- COMMAND [ARGS...]",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, metavar="N",
                   help="workers to run on this host (default: 1, or the slots the discovery script "
                        "gives this host; under srun SLURM_GPUS_ON_NODE, else SLURM_NTASKS_PER_NODE); torchrun's "
                        "--nproc-per-node is the same")
    p.add_argument("--gpus-per-host", type=int, metavar="N",
                   help="one worker per GPU on the first N GPUs of this host: each worker's CUDA_VISIBLE_DEVICES "
                        "names its GPU for its whole life (a respawn gets the same one) and LOCAL_RANK is 0, so "
                        ".cuda() and torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) pick it; the slot is in "
                        "ELASTIC_LOCAL_SLOT. Default: the GPUs this launcher sees (its CUDA_VISIBLE_DEVICES, else "
                        "/proc/driver/nvidia/gpus), none without; 0: place no worker on a GPU")
    p.add_argument("--min-np", type=int, metavar="N",
                   help="the job waits while it has fewer than N workers, and fails after "
                        "--elastic-timeout (default: the job's, whenever this launcher's workers join; a job "
                        "they create gets --np, as horovodrun, so the first world has them all, and under srun "
                        "--np times the step's nodes. At most --np without --rendezvous outside Slurm)")
    p.add_argument("--max-np", type=int, metavar="N",
                   help=f"workers beyond N wait on standby (default: the job's; a job this launcher's workers "
                        f"create gets {DEFAULT_MAX_NP})")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="respawn a worker killed by a signal at most N times per slot, with backoff "
                        "(0: never; default: %(default)s)")
    p.add_argument("--elastic-timeout", type=float, default=600.0, metavar="S",
                   help="seconds the job may stay below --min-np before it fails (default: %(default)g)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--port", type=int, default=0, metavar="P",
                       help="port of the embedded rendezvous server (default: a free one)")
    where.add_argument("--rendezvous", metavar="HOST:PORT[,HOST:PORT...]",
                       help="join a job on these rendezvous servers instead of starting one")
    p.add_argument("--rendezvous-dir", metavar="DIR",
                   help="under srun without --rendezvous: a directory every node of the Slurm job shares, where "
                        "the batch host's elastic-run announces its embedded server (address, and token in a 0600 "
                        "file) to the others (default: ~/.elastic-run)")
    p.add_argument("--job-id", metavar="ID",
                   help="job id, [A-Za-z0-9._-] (default: SLURM_JOB_ID under srun, else 'default'; required "
                        "with --rendezvous outside Slurm)")
    p.add_argument("--host", metavar="NAME",
                   help="this host's name in the job (default: SLURMD_NODENAME under srun, else the hostname); "
                        "give two launchers on one machine different names")
    p.add_argument("--host-discovery-script", metavar="PATH",
                   help="executable printing 'host[:slots]' lines (horovodrun format), polled: "
                        "the slots listed for THIS host (--host, or localhost) set how many workers "
                        "run here; other hosts are reported, not started (run elastic-run there)")
    p.add_argument("--discovery-interval", type=float, default=1.0, metavar="S",
                   help="seconds between runs of the discovery script (default: %(default)g)")
    p.add_argument("--connect-timeout", type=float, metavar="S",
                   help="give up when no --rendezvous server answers within S seconds at start "
                        "(default: 10; under srun, 60 for the batch host's server to be announced)")
    add_client_flags(p, for_workers=True)   # --token-file, --tls-ca, --tls-cert, --tls-key
    p.add_argument("--stop-timeout", type=float, default=10.0, metavar="S",
                   help="after the job ended, SIGKILL workers still running S seconds after SIGTERM; "
                        "on Ctrl-C/SIGTERM (draining) and discovery scale-down, --preempt-grace + S seconds "
                        "after it (default: %(default)g)")
    p.add_argument("--preempt-grace", type=float, default=30.0, metavar="S",
                   help="a worker sent SIGTERM (by this launcher draining, or by the platform) leaves the job "
                        "at its next commit; one that reaches none within S seconds ends as a failure. "
                        "Passed to workers as ELASTIC_PREEMPT_GRACE (default: %(default)g)")
    p.add_argument("--metrics-port", type=int, metavar="P",
                   help="serve Prometheus metrics of this host's workers (steps, allreduce by transport, commit, "
                        "sync, recoveries, world version; labels rank and worker) and of this launcher (restarts "
                        "per slot, workers alive) on http://--metrics-host:P/metrics; 0 picks a free port, "
                        "printed at start. The workers push to this launcher: no port per worker "
                        "(default: no metrics, and the workers record none)")
    p.add_argument("--metrics-host", metavar="ADDR",
                   help="address the --metrics-port endpoint listens on (default: 127.0.0.1; 0.0.0.0 for a "
                        "Prometheus on another machine)")
    p.add_argument("--events", metavar="FILE",
                   help="append one JSON line per event to FILE (worker_started, worker_exited, "
                        "worker_respawned, world_formed, recovery, preempted, job_finished), with job_id, "
                        "world_version and timestamps, for log shippers (see rendezvous/common/event_log.py)")
    p.add_argument("--preload", metavar="MODULE[,MODULE...]",
                   help="import these modules (e.g. torch) once, in a fork server, and fork every worker and "
                        "every respawn from it: a worker starts in milliseconds instead of importing them again, "
                        "on the cores the others train on. Needs a worker command this Python runs, 'python "
                        "SCRIPT ...' or 'python -m MODULE ...'. A module that reads a per-worker variable (RANK, "
                        "LOCAL_RANK, CUDA_VISIBLE_DEVICES) at import must not be preloaded; torch reads them when "
                        "it first uses a device. A worker's first torch.optim optimizer imports torch._dynamo "
                        "(seconds of CPU): --preload torch,torch._dynamo spares it that too (default: none: every "
                        "worker is a new process)")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                   help="print elastic-run's version and exit")
    p.add_argument("--collective-timeout", type=float, metavar="S",
                   help="seconds a worker may stay in one collective (an allreduce, DDP's gradient buckets, "
                        "the check at a commit) before it fails and the world re-forms: set it above the "
                        "longest time one rank works alone (evaluation, saving) and "
                        "the longest transfer. Hung, stopped or partitioned workers are found by the rendezvous "
                        "heartbeat within a second whatever it is. Passed to workers as "
                        "ELASTIC_COLLECTIVE_TIMEOUT (default: $ELASTIC_COLLECTIVE_TIMEOUT, else "
                        f"{CommConfig().timeout:g}, torch's gloo default)")
    slow = StragglerConfig()
    p.add_argument("--straggler-policy", choices=POLICIES, default=slow.policy, type=str.lower,
                   help="what happens to a straggler: a worker whose compute time between two commits (the time it "
                        "spends outside collectives) stays above --straggler-factor times its world's median for "
                        "--straggler-windows windows in a row. report: it is named (a line here, the "
                        "straggler_detected event, the elastic_straggler_score metric, the PACE column of "
                        "elastic-rendezvous status); evict: also, the worst straggler leaves at its next commit like a "
                        "preempted worker (the others keep their state, nothing is redone), unless the job would drop "
                        "below --min-np with no spare on another host to take its place; its host enters the "
                        "rendezvous blacklist cooldown, and its slot is retired (never respawned into the same slow "
                        "spot; a spare on another host takes the place); off: nothing is measured. A world slow everywhere "
                        "names nobody. Passed to workers as ELASTIC_STRAGGLER_POLICY (default: %(default)s)")
    p.add_argument("--straggler-factor", type=float, default=slow.factor, metavar="F",
                   help="a worker is slow in a window when its compute time is above F times its world's median "
                        "(ELASTIC_STRAGGLER_FACTOR; default: %(default)g)")
    p.add_argument("--straggler-windows", type=int, default=slow.windows, metavar="K",
                   help="slow windows in a row that make a worker a straggler: one slow window (a garbage "
                        "collection, an evaluation on one rank) names nobody (ELASTIC_STRAGGLER_WINDOWS; default: "
                        "%(default)s)")
    p.add_argument("--straggler-window", type=float, default=slow.window_s, metavar="S",
                   help="the shortest window: the commits of at least S seconds of training count as one; a job "
                        "that commits less often has one window per commit (ELASTIC_STRAGGLER_WINDOW; default: "
                        "%(default)g)")
    level = p.add_mutually_exclusive_group()
    level.add_argument("--log-level", choices=LOG_LEVELS, default="info", type=str.lower,
                       help="what the workers' elastic runtime logs (ELASTIC_LOG_LEVEL: rank of each world, standby, "
                            "recoveries) and, above info, fewer lines of this launcher's own (default: %(default)s). "
                            "A worker script that configures logging itself (logging.basicConfig ...) keeps its own")
    level.add_argument("--quiet", action="store_true",
                       help="--log-level warning: only failures, recoveries, leaves and the end are printed")
    add_torchrun_flags(p)
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the worker command, after '--' (-- python train.py ARGS); a script ending in .py runs "
                        "with this Python, as torchrun runs it (train.py ARGS)")
    return p


LOG_LEVELS = ("debug", "info", "warning", "error")


def _tls(a: argparse.Namespace, embedded: bool, env: Mapping[str, str]) -> Tuple[Optional[str], ...]:
    """The TLS files (absolute paths, checked readable): from the flags, else from the variables
    the workers would read anyway; none for the embedded server (plaintext on 127.0.0.1)."""
    flags = (a.tls_ca, a.tls_cert, a.tls_key)
    if embedded:
        given = [f for f, v in zip(TLS_FLAGS, flags) if v]
        if given:
            raise UsageError(f"{given[0]} needs --rendezvous: the embedded rendezvous server has no TLS")
        return (None, None, None)
    if not any(flags):
        flags = tuple(env.get(name) or None for name in TLS_VARIABLES)
        names: Sequence[str] = TLS_VARIABLES
    else:
        names = TLS_FLAGS
    try:
        channel_credentials(*flags, names=names)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return tuple(os.path.abspath(f) if f else None for f in flags)


def worker_command(command: Sequence[str], python: str, is_file: Callable[[str], bool],
                   which: Callable[[str], Optional[str]]) -> List[str]:
    """The command each worker runs, from what followed the flags (a pure decision). A script
    ending in ``.py`` runs with this launcher's Python, as torchrun runs it; anything else must be
    an executable or a name on PATH."""
    if not command:
        raise UsageError("no worker command: put it after '--', e.g. elastic-run --np 2 -- python train.py")
    first = command[0]
    if first.endswith(".py"):
        if not is_file(first):
            raise UsageError(f"worker script {first!r} not found (elastic-run runs a .py file with this Python, "
                             f"{python}, as torchrun does)")
        return [python, *command]
    if which(first) is None:
        raise UsageError(f"worker command {first!r} not found (not an executable, nor on PATH; a script runs as "
                         f"'elastic-run ... train.py' or '-- python train.py')")
    return list(command)


def parse(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> LaunchConfig:
    env = os.environ if env is None else env
    a = parser().parse_args(argv)
    command: List[str] = list(a.command)
    if command and command[0] == "--":
        command = command[1:]
    command = worker_command(command, sys.executable, os.path.isfile, shutil.which)
    try:
        slurm = from_slurm_env(env)
        rendezvous = parse_addresses(a.rendezvous, "--rendezvous") if a.rendezvous is not None else ()
    except ValueError as e:
        raise UsageError(str(e)) from None
    # Under srun in a job of several nodes without --rendezvous, the launchers of the job find each
    # other: the batch host's serves, the others join it (elastic/launch/slurm.py).
    role = "" if slurm is None or rendezvous or not slurm.spans_nodes else ("head" if slurm.is_head else "member")
    if a.np is not None and a.np < (0 if a.host_discovery_script else 1):
        raise UsageError(f"--np must be at least 1, got {a.np}")
    np_ = a.np if a.np is not None else (0 if a.host_discovery_script else
                                         slurm.workers_per_node if slurm is not None else 1)
    min_np = max(1, np_) * (slurm.step_nodes if slurm is not None else 1) if a.min_np is None else a.min_np
    max_np = DEFAULT_MAX_NP if a.max_np is None else a.max_np
    if min_np < 1 or max_np < min_np or max_np > 2048:
        raise UsageError(f"need 1 <= --min-np <= --max-np <= 2048, got {min_np} and {max_np}")
    if min_np > np_ and not rendezvous and not role and not a.host_discovery_script:
        # Without --rendezvous the job is this launcher's: at most --np workers at a time (a
        # respawn takes its slot's place), so a first world of --min-np could never form. With
        # --host-discovery-script the slots, up to --max-np, come later: --min-np <= --max-np is the
        # most that can be checked.
        raise UsageError(f"--min-np {min_np} is more than --np {np_}, the workers this launcher runs: the "
                         "job could never start (lower --min-np, raise --np, or join a job of several "
                         "launchers with --rendezvous)")
    if a.max_restarts < 0:
        raise UsageError(f"--max-restarts must not be negative, got {a.max_restarts}")
    if not 0 < a.elastic_timeout <= 7 * 86400:
        raise UsageError(f"--elastic-timeout must be in (0, 604800] seconds, got {a.elastic_timeout:g}")
    if not 0 <= a.port < 65536:
        raise UsageError(f"--port {a.port} is outside 0..65535")
    connect_timeout = a.connect_timeout if a.connect_timeout is not None else 60.0 if role == "member" else 10.0
    if a.stop_timeout < 0 or a.discovery_interval <= 0 or connect_timeout <= 0:
        raise UsageError("--stop-timeout must be >= 0, --discovery-interval and --connect-timeout > 0")
    if not 0 < a.preempt_grace <= 86400:
        raise UsageError(f"--preempt-grace must be in (0, 86400] seconds, got {a.preempt_grace:g}")
    if rendezvous and not a.job_id and slurm is None:
        raise UsageError("--rendezvous needs --job-id: the job these workers join")
    job_id = a.job_id or (slurm.job_id if slurm is not None else "default")
    if not ID_RE.fullmatch(job_id):
        raise UsageError(f"--job-id {job_id!r}: use 1-128 characters of [A-Za-z0-9._-]")
    host = a.host or _host_name(slurm.node if slurm is not None else socket.gethostname())
    if not ID_RE.fullmatch(host) or len(host) > 100:
        raise UsageError(f"--host {host!r}: use 1-100 characters of [A-Za-z0-9._-]")
    script = a.host_discovery_script
    if script is not None and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        raise UsageError(f"--host-discovery-script {script!r} is not an executable file")
    if a.token_file is not None and not rendezvous:
        raise UsageError("--token-file needs --rendezvous: the embedded server makes its own random token")
    token = _token(a.token_file, env) if rendezvous else None
    tls_ca, tls_cert, tls_key = _tls(a, not rendezvous, env)
    announce_dir = _announce_dir(a, slurm, role, job_id, env)
    embedded_host = EMBEDDED_HOST
    try:
        if role == "head":
            embedded_host = serve_host(env.get("ELASTIC_RING_HOST", ""), host_address)
        if not rendezvous and role != "member":   # where the embedded server will listen
            check_can_listen(embedded_host, a.port, "--port")
    except ValueError as e:
        raise UsageError(str(e)) from None
    collective_timeout = _collective_timeout(a.collective_timeout)
    stragglers = _stragglers(a)
    metrics_host = _metrics_endpoint(a, rendezvous)
    events = _events_file(a.events)
    preload = _preload(a.preload, command)
    try:
        gpus = placement(a.gpus_per_host, visible_gpus(env), np_, discovery=script is not None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return LaunchConfig(command=tuple(command), np=np_, min_np=min_np, max_np=max_np,
                        min_np_given=a.min_np is not None, max_np_given=a.max_np is not None,
                        max_restarts=a.max_restarts, elastic_timeout=a.elastic_timeout, port=a.port,
                        rendezvous=rendezvous, job_id=job_id, host=host, host_discovery_script=script,
                        discovery_interval=a.discovery_interval, token_file=a.token_file,
                        tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                        stop_timeout=a.stop_timeout, connect_timeout=connect_timeout,
                        preempt_grace=a.preempt_grace, collective_timeout=collective_timeout,
                        log_level="WARNING" if a.quiet else a.log_level.upper(),
                        omp_num_threads=None if env.get("OMP_NUM_THREADS") or np_ == 1 else "1",
                        metrics_port=a.metrics_port, metrics_host=metrics_host,
                        events=events, token=token, stragglers=stragglers,
                        inherited_token_env=tuple((k, env[k]) for k in (TOKEN_VARIABLE, TOKEN_FILE.variable)
                                                  if env.get(k)),
                        embedded_host=embedded_host, slurm=slurm, slurm_role=role, announce_dir=announce_dir,
                        preload=preload, gpus=gpus)


MODULE_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _preload(value: Optional[str], command: Sequence[str]) -> Tuple[str, ...]:
    """--preload's modules, checked: names of modules, and a worker command the fork server can run."""
    if value is None:
        return ()
    modules = tuple(m.strip() for m in value.split(","))
    bad = [m for m in modules if not MODULE_RE.fullmatch(m)]
    if bad:
        raise UsageError(f"--preload {value!r}: give module names separated by commas, e.g. --preload torch")
    if forkable(command) is None:
        raise UsageError(f"--preload needs a worker command this Python ({sys.executable}) runs as 'python SCRIPT "
                         f"...' or 'python -m MODULE ...', got {' '.join(command[:3])!r}")
    return modules


def _host_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)[:100] or "localhost"


def _announce_dir(a: argparse.Namespace, slurm: Optional[SlurmStep], role: str, job_id: str,
                  env: Mapping[str, str]) -> Optional[str]:
    """Where the batch host's launcher announces its server (see elastic/launch/slurm.py): a
    subdirectory of --rendezvous-dir, which the batch host's launcher creates (0700) if needed."""
    if not role:
        if a.rendezvous_dir is not None:
            raise UsageError("--rendezvous-dir is for elastic-run under srun in a Slurm job of several nodes, "
                             "without --rendezvous")
        return None
    base = a.rendezvous_dir or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".elastic-run")
    base = os.path.abspath(base)
    try:
        if role == "head" or os.path.exists(base):
            check_base_dir(base, create=role == "head")
    except SlurmEnvError as e:
        raise UsageError(str(e)) from None
    return announcement_dir(base, slurm, job_id)


def _collective_timeout(seconds: Optional[float]) -> Optional[float]:
    """--collective-timeout, checked where the setting is defined (elastic.CommConfig)."""
    if seconds is None:
        return None
    try:
        CommConfig(timeout=seconds)
    except ValueError as e:
        raise UsageError(f"--collective-timeout {seconds:g}: {e}") from None
    return seconds


def _stragglers(a: argparse.Namespace) -> StragglerConfig:
    """The --straggler-* flags, checked where the settings are defined (elastic.runtime.straggler_detector)."""
    given = {"policy": a.straggler_policy, "factor": a.straggler_factor, "windows": a.straggler_windows,
             "window_s": a.straggler_window}
    for name, value in given.items():
        why = StragglerConfig.problem(name, value)
        if why is not None:
            raise UsageError(f"{StragglerConfig.flag(name)} {value}: {why}")
    return StragglerConfig(**given)


def _metrics_endpoint(a: argparse.Namespace, rendezvous: Tuple[str, ...]) -> str:
    """--metrics-host, checked with --metrics-port: the address can be listened on, the port is free."""
    host = a.metrics_host or "127.0.0.1"
    if a.metrics_port is None:
        if a.metrics_host is not None:
            raise UsageError("--metrics-host needs --metrics-port")
        return host
    if not 0 <= a.metrics_port < 65536:
        raise UsageError(f"--metrics-port {a.metrics_port} is outside 0..65535")
    if not rendezvous and a.metrics_port and a.metrics_port == a.port:
        raise UsageError(f"--metrics-port {a.metrics_port} is also --port, the embedded rendezvous server's")
    try:
        check_can_listen(host, a.metrics_port, "--metrics-port")
        if a.metrics_port == 0:   # a free port is always there; the address must still be ours
            check_can_listen(host, _free_port_on(host), "--metrics-host")
    except ValueError as e:
        raise UsageError(str(e)) from None
    return host


def _free_port_on(host: str) -> int:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    except OSError as e:
        raise ValueError(f"--metrics-host {host}: cannot listen there: {e.strerror}") from None


def _events_file(path: Optional[str]) -> Optional[str]:
    """--events FILE as an absolute path, checked now (appendable, no symbolic link); the check
    creates nothing: the event log opens it when the launcher starts."""
    if path is None:
        return None
    if not path or os.path.isdir(path):
        raise UsageError(f"--events {path!r}: give a file to append to, not a directory")
    try:
        files.check_log(path)
    except OSError as e:
        raise UsageError(f"--events {path}: cannot open for appending: {files.reason(e)}") from None
    return os.path.abspath(path)


def _token(token_file: Optional[str], env: Mapping[str, str]) -> Optional[str]:
    """The token for --rendezvous servers: --token-file, else what the workers will read
    (ELASTIC_TOKEN, then ELASTIC_TOKEN_FILE, as elastic.runtime.worker_config does)."""
    try:
        if token_file:
            return read_token_file(token_file, "--token-file")
        if env.get(TOKEN_VARIABLE):
            return env[TOKEN_VARIABLE]
        if env.get(TOKEN_FILE.variable):
            return read_token_file(env[TOKEN_FILE.variable], TOKEN_FILE.variable)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return None
