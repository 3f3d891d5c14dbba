"""Local worker processes: spawn each in its own process group, prefix its output with its worker
id, describe how it ended, and stop it (SIGTERM to the group, SIGKILL after a deadline).

The prefix is the worker id (``[HOST-SLOT]``, ``[HOST-SLOT-rN]`` after the N-th respawn) for the
process's whole life: a rank changes with every world and a line printed before the first world,
on standby or after the job ended has none, while the id is fixed, unique across hosts, and the
one the launcher's own lines, ELASTIC_WORKER_ID and `elastic-rendezvous status` use.

Nothing here reads a worker's output to decide anything: how a worker ended comes from its exit
status; its last stderr lines are kept only to quote its error in the launcher's one-line reason.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from elastic.runtime.errors import DIVERGED_EXIT
from elastic.runtime.worker_config import DEVICE_ABORT_STUCK_EXIT

if TYPE_CHECKING:
    from elastic.launch.forkserver import ForkedProcess, ForkServer

# The last line of a Python traceback: "ValueError: ...", "elastic.ring.errors.WorkerLostError: ...".
# Display text only (quoted in the launcher's reason for a failed job), never a decision.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Finished|Timeout)\b(:|$)")


# Runs before the real command, in the same process (exec): die with the launcher even if the
# launcher is SIGKILLed (PR_SET_PDEATHSIG survives exec). Not a preexec_fn: forking a process that
# runs gRPC threads without exec'ing at once can abort the child inside gRPC's fork handlers.
_PDEATHSIG_SHIM = ("import ctypes,os,sys\n"
                   "try: ctypes.CDLL(None).prctl(1, 9)\n"
                   "except Exception: pass\n"
                   "if os.getppid() != int(sys.argv[1]): sys.exit(137)\n"
                   "os.execvp(sys.argv[2], sys.argv[2:])\n")


def raise_open_files_limit() -> Tuple[int, int]:
    """Raises this process's soft limit on open files to its hard limit (the workers inherit it)
    and returns (soft, hard) as they are now. Every worker costs the launcher pipes and a
    process handle, and a soft limit of 1,024 (the usual default) would make a respawn fail
    with EMFILE long before the hard limit does."""
    import resource   # POSIX only, as this module

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:   # the kernel still caps descriptors at fs.nr_open
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            return soft, hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard


def with_parent_death_signal(command: Sequence[str]) -> List[str]:
    """``command`` wrapped so that it is SIGKILLed when this process dies (Linux; elsewhere as is)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid()), *command]


class Output:
    """Writes worker lines to the launcher's stdout/stderr, prefixed with the worker's id."""

    def __init__(self, out: IO[bytes], err: IO[bytes], quiet: bool = False):
        self._streams = {"out": out, "err": err}
        self._lock = threading.Lock()
        self.quiet = quiet   # --quiet / --log-level above info: routine launcher lines are not printed

    def line(self, stream: str, worker_id: Optional[str], data: bytes) -> None:
        if not data.endswith(b"\n"):
            data += b"\n"
        if worker_id is not None:
            data = f"[{worker_id}] ".encode() + data
        with self._lock:
            s = self._streams[stream]
            try:
                s.write(data)
                s.flush()
            except (OSError, ValueError):
                pass   # our own stdout closed (e.g. piped to head): keep the job going

    def note(self, text: str) -> None:
        """A launcher line (on stderr)."""
        self.line("err", None, f"elastic-run: {text}".encode())

    def info(self, text: str) -> None:
        """A routine launcher line (what started, which world formed): not printed when quiet."""
        if not self.quiet:
            self.note(text)


def exception_line(lines: Sequence[str], fallback: bool = True) -> str:
    """The last exception line of a traceback among ``lines`` (noise may follow it), else the last
    line (or nothing, without ``fallback``)."""
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return line
    return lines[-1] if lines and fallback else ""


def describe_exit(code: int) -> str:
    sig = signal_of(code)
    if sig is not None:
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    if code == DEVICE_ABORT_STUCK_EXIT:
        return f"exited with status {code} (the abort of its device communicator did not return)"
    if code == DIVERGED_EXIT:
        return (f"exited with status {code} (outvoted: it called other collectives, or formed its ring with other "
                "settings, than the majority of its world)")
    return f"exited with status {code}"


def respawnable(code: int) -> bool:
    """A worker that ended this way while its job ran is replaced: killed by a signal, wedged
    in an abort of its device communicator (``DEVICE_ABORT_STUCK_EXIT``), or outvoted by its
    world (``DIVERGED_EXIT``, see ``plan_exit``). Any other status is the worker's own error,
    which ends the job."""
    return signal_of(code) is not None or code in (DEVICE_ABORT_STUCK_EXIT, DIVERGED_EXIT)


# A slot whose worker was outvoted this many times is respawned no more: a data-dependent branch
# may not diverge again, but a stale image or other ring settings diverge every time.
DIVERGED_LIMIT = 3


@dataclasses.dataclass(frozen=True)
class ExitPlan:
    """What elastic-run does about a worker that exited while its job ran: respawn its slot
    after ``delay`` seconds, retire it (the job goes on without it), or (``fail``) end with it.
    ``note`` is what it says after "worker W (rank R) exited ...; "."""

    respawn: bool
    delay: float = 0.0
    note: str = ""
    fail: bool = False


def plan_exit(code: int, restarts: int, max_restarts: int, outvoted: int) -> ExitPlan:
    """The plan for a worker of a slot respawned ``restarts`` times so far (``--max-restarts``
    ``max_restarts``), outvoted ``outvoted`` times before, that exited with ``code``."""
    if not respawnable(code):
        return ExitPlan(False, fail=True)
    if code == DIVERGED_EXIT and outvoted + 1 >= DIVERGED_LIMIT:
        return ExitPlan(False, note=f"not respawned: outvoted {outvoted + 1} times (check that every host runs the "
                                    "same program and image with the same ELASTIC_* ring settings); the job goes on "
                                    "without it")
    if restarts >= max_restarts:
        return ExitPlan(False, note=f"not respawned (--max-restarts {max_restarts}"
                                    + (" used up)" if max_restarts else ")"))
    delay = min(0.5 * 2 ** restarts, 10.0)
    times = f", outvoted {outvoted + 1} of {DIVERGED_LIMIT} times" if code == DIVERGED_EXIT else ""
    return ExitPlan(True, delay, f"respawning it in {delay:.1f} s (restart {restarts + 1} of {max_restarts}{times})")


def signal_of(code: int) -> Optional[int]:
    """The signal that ended a worker: Popen's -N, or 128+N from a shell that ran it."""
    if code < 0:
        return -code
    if 128 < code < 128 + 65:
        return code - 128
    return None


class Worker:
    """One local worker process (one incarnation of a slot)."""

    def __init__(self, slot: int, restart: int, worker_id: str, command: Sequence[str],
                 env: Mapping[str, str], output: Output, forkserver: Optional["ForkServer"] = None):
        self.slot, self.restart, self.worker_id = slot, restart, worker_id
        self.output = output
        self.tail: "collections.deque[str]" = collections.deque(maxlen=20)
        self.started_at = time.monotonic()
        self.ended_at: Optional[float] = None
        self.stopping = False            # the launcher is stopping it: its end is no failure
        self.stop_deadline: Optional[float] = None   # when a worker being drained is SIGKILLed
        # It left the job gracefully (exited 0 while the job ran: preempted, drained): its end
        # counts as a success and its slot is not respawned.
        self.left = False
        self.handled = False             # the launcher has acted on its exit
        if forkserver is not None:   # --preload: forked from the server that imported the heavy modules
            self.proc: "subprocess.Popen | ForkedProcess" = forkserver.spawn(command, env)
        else:
            self.proc = subprocess.Popen(with_parent_death_signal(command), env=dict(env), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.pid = self.proc.pid
        self._readers: List[threading.Thread] = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, "out"), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, "err"), daemon=True)]
        for t in self._readers:
            t.start()

    def _pump(self, pipe: IO[bytes], stream: str) -> None:
        for raw in pipe:
            if stream == "err" and raw.strip():
                self.tail.append(raw.decode(errors="replace").strip())
            self.output.line(stream, self.worker_id, raw)
        pipe.close()

    def poll(self) -> Optional[int]:
        code = self.proc.poll()
        if code is not None and self.ended_at is None:
            self.ended_at = time.monotonic()
        return code

    @property
    def alive(self) -> bool:
        return self.poll() is None

    def last_error_line(self, fallback: bool = True) -> str:
        """The exception line that ended its traceback ('ValueError: ...'), else its last stderr
        line (or nothing, without ``fallback``)."""
        self.join_output(1.0)
        return exception_line(list(self.tail), fallback)

    def join_output(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self._readers:
            t.join(max(0.0, deadline - time.monotonic()))

    def signal(self, sig: int) -> None:
        """``sig`` to the worker's own process only."""
        try:
            os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def drain(self, deadline: float) -> None:
        """Asks it to leave the job (SIGTERM: it leaves at its next commit); SIGKILL after ``deadline``.

        To its own process, not its group: a DataLoader's worker processes die of SIGTERM, and
        the worker needs them to reach its next commit. The group is killed at the deadline."""
        self.stopping = True
        self.stop_deadline = deadline
        self.signal(signal.SIGTERM)

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_all(workers: Sequence[Worker], timeout_s: float, hurry: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM every worker's process group, SIGKILL what is left after ``timeout_s`` (or as soon
    as ``hurry()``: a second Ctrl-C), and reap all."""
    for w in workers:
        w.stopping = True
        if w.alive:
            w.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(w.alive for w in workers) and time.monotonic() < deadline and not hurry():
        time.sleep(0.02)
    for w in workers:
        # Also the groups whose leader is gone: a grandchild (a DataLoader worker) may live on.
        w.signal_group(signal.SIGKILL)
    for w in workers:
        w.proc.wait()
        w.join_output(2.0)


# Set for every worker unless its environment has them: output line by line, and none of gRPC's
# own log lines (INFO lines such as fork_posix.cc's "skipping fork() handlers" at every
# DataLoader worker fork, chttp2's "Got goaway ... ping_timeout"); gRPC's errors still show.
# No fork handlers: a worker's forked children (DataLoader workers) never use gRPC.
WORKER_DEFAULTS = {"PYTHONUNBUFFERED": "1", "GRPC_VERBOSITY": "ERROR", "GRPC_ENABLE_FORK_SUPPORT": "0"}


def worker_env(base: Mapping[str, str], extra: Mapping[str, str], drop: Sequence[str] = ()) -> Dict[str, str]:
    """``base`` without the variables in ``drop``, with ``extra`` on top, and WORKER_DEFAULTS where
    neither sets them."""
    env = {k: v for k, v in base.items() if k not in drop}
    env.update(extra)
    for name, value in WORKER_DEFAULTS.items():
        env.setdefault(name, value)
    return env


def stdout_streams() -> Tuple[IO[bytes], IO[bytes]]:
    return sys.stdout.buffer, sys.stderr.buffer
