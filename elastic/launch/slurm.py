"""`elastic-run` under Slurm's `srun`: what Slurm's environment says, and how the nodes find the server.

One `elastic-run` per node, started by `srun --ntasks-per-node=1`. Each reads its place in the
Slurm job from the variables `srun` and `slurmd` set (``from_slurm_env``, a pure function):
the job id (SLURM_JOB_ID), this node's name (SLURMD_NODENAME), the job's nodes
(SLURM_JOB_NODELIST), how many workers to run here when --np is not given (the GPUs Slurm gives
this node, SLURM_GPUS_ON_NODE, else the job's --ntasks-per-node), and how many `elastic-run` the
step started on this node (more than one is refused: they would share the node's slots).

Without --rendezvous, the first node of the job's node list (the batch host) runs the embedded
rendezvous server on its cluster address and *announces* it to the others through a directory
all the job's nodes share (--rendezvous-dir, default ~/.elastic-run): a per-job subdirectory,
mode 0700, holding the server's address and its random token (mode 0600). Only the job's user
(and root) can read the token, as with the single-machine embedded server; the other nodes wait
for the announcement, then join as with --rendezvous ADDRESS --token-file FILE. The batch host
is then a single point of failure for the job, as it is for Slurm's own batch script; jobs that
must outlive any node use `elastic-rendezvous serve` replicas over etcd and --rendezvous.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import time
from typing import Callable, List, Mapping, Optional, Tuple

from rendezvous.common.channel import is_loopback, parse_addresses, read_token_file
from rendezvous.client.status_client import StatusClient, StatusError

MAX_NODES = 65536        # a node list expanding to more is refused (a typo like n[1-99999999])


class SlurmEnvError(ValueError):
    """Slurm's environment is unusable for elastic-run; the message is one line naming the variable."""


@dataclasses.dataclass(frozen=True)
class SlurmStep:
    """Where this `elastic-run` stands in a Slurm job (from ``from_slurm_env``)."""

    job_id: str                  # SLURM_JOB_ID
    node: str                    # SLURMD_NODENAME: this node
    job_nodes: Tuple[str, ...]   # SLURM_JOB_NODELIST, expanded; the first is the batch host
    step_nodes: int              # SLURM_STEP_NUM_NODES: launchers this srun started (one per node)
    restart_count: int           # SLURM_RESTART_COUNT: how many times the job was requeued
    workers_per_node: int        # the --np default: SLURM_GPUS_ON_NODE, else SLURM_NTASKS_PER_NODE, else 1
    np_source: str               # which variable gave workers_per_node ("" for the default 1)

    @property
    def head(self) -> str:
        """The node whose elastic-run serves the rendezvous (without --rendezvous): the batch host."""
        return self.job_nodes[0]

    @property
    def is_head(self) -> bool:
        return self.node == self.head

    @property
    def spans_nodes(self) -> bool:
        """More than one node in the job: the embedded server is announced to the others."""
        return len(self.job_nodes) > 1


def expand_hostlist(text: str, what: str = "SLURM_JOB_NODELIST") -> List[str]:
    """Slurm's compressed host list, expanded in order: "n[01-03,7],gpu5" -> n01 n02 n03 n07 gpu5.

    Several bracket groups in one name multiply ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2); a range
    keeps the width of its lower bound ("[08-10]" -> 08 09 10)."""
    names: List[str] = []
    for item in _split_top(text.strip(), what):
        pieces = re.split(r"(\[[^\[\]]*\])", item)
        expanded = [""]
        for piece in pieces:
            if piece.startswith("["):
                choices = _bracket(piece[1:-1], text, what)
            elif "[" in piece or "]" in piece:
                raise SlurmEnvError(f"{what}={text!r}: unbalanced brackets")
            else:
                choices = [piece]
            expanded = [a + b for a in expanded for b in choices]
            if len(names) + len(expanded) > MAX_NODES:
                raise SlurmEnvError(f"{what}={text!r} names more than {MAX_NODES} nodes")
        names.extend(expanded)
    if not names or any(not n for n in names):
        raise SlurmEnvError(f"{what}={text!r}: an empty node name")
    return names


def _split_top(text: str, what: str) -> List[str]:
    """Splits on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SlurmEnvError(f"{what}={text!r}: nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(f"{what}={text!r}: unbalanced brackets")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmEnvError(f"{what}={text!r}: unbalanced brackets")
    items.append(text[start:])
    return items


def _bracket(body: str, text: str, what: str) -> List[str]:
    out: List[str] = []
    for part in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise SlurmEnvError(f"{what}={text!r}: {part!r} is not a number or a range of numbers")
        lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(hi) < int(lo):
            raise SlurmEnvError(f"{what}={text!r}: the range {part!r} runs backwards")
        if int(hi) - int(lo) + len(out) >= MAX_NODES:
            raise SlurmEnvError(f"{what}={text!r} names more than {MAX_NODES} nodes")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def expand_counts(text: str, what: str) -> List[int]:
    """Slurm's compressed per-node counts: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: List[int] = []
    for part in text.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise SlurmEnvError(f"{what}={text!r}: {part!r} is not COUNT or COUNT(xREPEAT)")
        repeat = int(m.group(2) or 1)
        if len(counts) + repeat > MAX_NODES:
            raise SlurmEnvError(f"{what}={text!r} covers more than {MAX_NODES} nodes")
        counts.extend([int(m.group(1))] * repeat)
    return counts


def _number(env: Mapping[str, str], name: str, default: Optional[int] = None) -> Optional[int]:
    raw = env.get(name, "").strip()
    if raw == "":
        return default
    if not raw.isdigit():
        raise SlurmEnvError(f"{name}={raw!r} is not a non-negative whole number")
    return int(raw)


def from_slurm_env(env: Mapping[str, str]) -> Optional[SlurmStep]:
    """This launcher's place in a Slurm job, or None outside an `srun` step.

    Inside one (SLURM_JOB_ID and SLURM_STEP_ID set; a batch script alone has no step id, and runs
    the single-machine default) the job's node list and this node's name are required. A step
    that starts several tasks on this node is refused: each would run the node's workers."""
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id or env.get("SLURM_STEP_ID", "").strip() == "":
        return None
    node = env.get("SLURMD_NODENAME", "").strip()
    if not node:
        raise SlurmEnvError("SLURMD_NODENAME is not set inside an srun step (SLURM_JOB_ID, SLURM_STEP_ID are): "
                            "give --host, --job-id and --np, and unset SLURM_STEP_ID")
    nodelist = env.get("SLURM_JOB_NODELIST", "").strip() or env.get("SLURM_NODELIST", "").strip()
    job_nodes = tuple(expand_hostlist(nodelist)) if nodelist else (node,)
    step_nodes = _number(env, "SLURM_STEP_NUM_NODES", 1) or 1
    tasks_here = _tasks_on_this_node(env)
    if tasks_here > 1:
        raise SlurmEnvError(f"srun started {tasks_here} tasks on node {node} (SLURM_STEP_TASKS_PER_NODE="
                            f"{env.get('SLURM_STEP_TASKS_PER_NODE', '?')}): run one elastic-run per node, which "
                            "starts that node's workers itself: srun --ntasks-per-node=1 elastic-run --np N ...")
    gpus = _number(env, "SLURM_GPUS_ON_NODE", 0)
    tasks_per_node = _number(env, "SLURM_NTASKS_PER_NODE", 0)
    if gpus:
        workers, source = gpus, "SLURM_GPUS_ON_NODE"
    elif tasks_per_node:
        workers, source = tasks_per_node, "SLURM_NTASKS_PER_NODE"
    else:
        workers, source = 1, ""
    return SlurmStep(job_id=job_id, node=node, job_nodes=job_nodes, step_nodes=step_nodes,
                     restart_count=_number(env, "SLURM_RESTART_COUNT", 0) or 0,
                     workers_per_node=workers, np_source=source)


def _tasks_on_this_node(env: Mapping[str, str]) -> int:
    """Tasks of this step on this node: SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID (its node index
    in the step), else the step's tasks over its nodes, rounded up."""
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE", "").strip()
    index = _number(env, "SLURM_NODEID")
    if per_node and index is not None:
        counts = expand_counts(per_node, "SLURM_STEP_TASKS_PER_NODE")
        if index < len(counts):
            return counts[index]
    tasks, nodes = _number(env, "SLURM_STEP_NUM_TASKS"), _number(env, "SLURM_STEP_NUM_NODES")
    if tasks and nodes:
        return -(-tasks // nodes)
    return 1


def serve_host(explicit: str, resolve: Callable[[], Tuple[str, str]]) -> str:
    """Where the batch host's embedded server listens: ELASTIC_RING_HOST when set (the address its
    workers' rings use too), else the address this host's name resolves to, which must not be a
    loopback one (the other nodes could not reach it). ``resolve()`` gives (name, address or "")."""
    if explicit:
        return explicit
    name, address = resolve()
    if address and not is_loopback(address):
        return address
    found = f"resolves to {address}, a loopback address" if address else "does not resolve"
    raise SlurmEnvError(f"this node's name {name!r} {found}, which the job's other nodes cannot reach: set "
                        "ELASTIC_RING_HOST to its address on the network the nodes share (the embedded rendezvous "
                        "server and the workers' rings listen there)")


# ---------------------------------------------------------------------- the announcement

SERVER_FILE = "server"    # HOST:PORT of the batch host's embedded server
TOKEN_FILE = "token"      # its token, mode 0600


def announcement_dir(base: str, step: SlurmStep, job_id: str) -> str:
    """The per-job subdirectory of --rendezvous-dir: one per Slurm job, requeue and elastic job id
    (a requeued job runs a new server; two jobs of one allocation need two --job-id)."""
    name = f"slurm-{step.job_id}.{step.restart_count}"
    if job_id != step.job_id:
        name += f"-{job_id}"
    return os.path.join(base, re.sub(r"[^A-Za-z0-9._-]", "_", name))


def check_base_dir(base: str, create: bool) -> None:
    """--rendezvous-dir must be this user's and writable by nobody else: whoever could write it could
    plant another server's address and token for the job's other nodes to join."""
    if create:
        try:
            os.makedirs(base, mode=0o700, exist_ok=True)
        except OSError as e:
            raise SlurmEnvError(f"--rendezvous-dir {base}: cannot create it: {e.strerror}") from None
    try:
        st = os.stat(base)
    except OSError as e:
        raise SlurmEnvError(f"--rendezvous-dir {base}: {e.strerror}") from None
    _check_owned(base, st, "--rendezvous-dir")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SlurmEnvError(f"--rendezvous-dir {base} (mode {stat.S_IMODE(st.st_mode):04o}) can be written by other "
                            f"users, who could plant a server for this job's nodes to join: chmod go-w {base}")


def _check_owned(path: str, st: os.stat_result, what: str) -> None:
    if st.st_uid != os.geteuid():
        raise SlurmEnvError(f"{what} {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")


class Announcement:
    """The batch host's side: the server's address and token in a fresh 0700 directory, removed by
    ``withdraw()``. A directory left by an earlier run of the same job (a launcher killed before it
    could withdraw) is replaced unless ``alive(address)`` says its server still answers."""

    def __init__(self, directory: str, address: str, token: str, alive: Callable[[str, str], bool]):
        self.directory = directory
        self.token_file = os.path.join(directory, TOKEN_FILE)
        old = _read_existing(directory)
        if old is not None and alive(*old):
            raise SlurmEnvError(f"{directory} announces a rendezvous server that still answers ({old[0]}): "
                                "another elastic-run step of this Slurm job serves the same job id; give this "
                                "one another --job-id")
        if old is not None or os.path.lexists(directory):
            _remove(directory)
        try:
            os.mkdir(directory, 0o700)
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
            # Published last, by a rename: a reader never sees a half-written address.
            tmp = os.path.join(directory, f".{SERVER_FILE}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(address + "\n")
            os.rename(tmp, os.path.join(directory, SERVER_FILE))
        except OSError as e:
            _remove(directory)
            raise SlurmEnvError(f"cannot announce the rendezvous server in {directory}: {e.strerror}") from None

    def withdraw(self) -> None:
        _remove(self.directory)


def server_answers(address: str, token: str, timeout_s: float = 2.0) -> bool:
    """Whether a rendezvous server answers a Status call at ``address`` with ``token``."""
    client = StatusClient((address,), token, None)
    try:
        client.status(timeout_s=timeout_s)
        return True
    except StatusError:
        return False
    finally:
        client.close()


def _read_existing(directory: str) -> Optional[Tuple[str, str]]:
    try:
        return read_announcement(directory)
    except (OSError, ValueError):
        return None


def _remove(directory: str) -> None:
    for name in (SERVER_FILE, TOKEN_FILE, f".{SERVER_FILE}.tmp"):
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass
    try:
        os.rmdir(directory)
    except OSError:
        pass


def read_announcement(directory: str) -> Optional[Tuple[str, str]]:
    """(address, token) from an announcement directory; None while it is not published yet.
    The directory and its files must be this user's and private (ValueError otherwise)."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        raise SlurmEnvError(f"{directory} is not a directory")
    _check_owned(directory, st, "announcement directory")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise SlurmEnvError(f"announcement directory {directory} (mode {stat.S_IMODE(st.st_mode):04o}) is open to "
                            "other users; it must be 0700")
    server = os.path.join(directory, SERVER_FILE)
    try:
        fd = os.open(server, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as f:
        _check_owned(server, os.fstat(f.fileno()), "announcement")
        raw = f.read(300).strip()
    addresses = parse_addresses(raw, f"the address in {server}")
    if len(addresses) != 1:
        raise SlurmEnvError(f"{server} holds {len(addresses)} addresses, not one")
    return addresses[0], read_token_file(os.path.join(directory, TOKEN_FILE), "the announced token file")


def wait_for_announcement(directory: str, head: str, timeout_s: float,
                          cancelled: Callable[[], bool] = lambda: False) -> Optional[Tuple[str, str]]:
    """(address, token) once the batch host's launcher announced its server; SlurmEnvError after
    ``timeout_s``; None if ``cancelled()`` first."""
    deadline = time.monotonic() + timeout_s
    while not cancelled():
        found = read_announcement(directory)
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise SlurmEnvError(f"no rendezvous server announced in {directory} within {timeout_s:g} s by the "
                                f"elastic-run of the batch host {head}: run this step on {head} too (it serves the "
                                "job), make --rendezvous-dir a directory every node of the job shares, or give "
                                "--rendezvous")
        time.sleep(0.1)
    return None
