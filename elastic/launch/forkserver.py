"""The fork server of `elastic-run --preload`: one process imports the heavy modules once, and every
worker (first start and respawn) is forked from it instead of starting Python and importing them again.

A respawned worker that imports torch itself spends seconds of CPU on it, on the cores the survivors
train on, and the job runs a worker short meanwhile. Forked from a process that holds torch already,
it starts in milliseconds and shares those pages copy-on-write. (torch.multiprocessing's
`forkserver` start method with `set_forkserver_preload` does the same for its children.)

Only a worker command this interpreter runs as `python SCRIPT ARGS` or `python -m MODULE ARGS`
(`-u` allowed) is forked (`forkable`); any other command starts as it always did. Importing torch
starts no Python thread and initialises no accelerator (CUDA initialises on first use, in the
worker), so forking after it is safe, as a DataLoader's workers rely on. What a preloaded module
reads from the environment at import, it reads from the server's environment (the launcher's
worker environment before any per-worker variable): a module that reads RANK, LOCAL_RANK or
CUDA_VISIBLE_DEVICES at import must not be preloaded (torch reads them when it first uses a device).
A forked worker differs from a new process in what a fork keeps: numpy's global random state is
reseeded in each (as a new process would seed it), the string hash seed is the server's for all,
and /proc/PID/environ shows the server's environment (os.environ is the worker's own).

The preloaded modules are imported from where the worker command itself would import them: the
server's sys.path[0] is the directory `python SCRIPT` puts there (the script's own, symlinks
resolved), or the working directory for `python -m MODULE` (`main_path`). Never the launcher's
working directory for a script elsewhere: whoever else can write there (a shared project
directory) would otherwise have a planted `numpy.py` run as this user.

The launcher and its server talk over a private socketpair (SOCK_SEQPACKET), one JSON object per
message, the worker's stdout and stderr pipes passed with the request (SCM_RIGHTS):
  server -> launcher   {"ready": true} or {"error": TEXT}, once, after the imports
  launcher -> server   {"seq": N, "argv": [...], "env": {...}, "cwd": PATH} with 2 descriptors
  server -> launcher   {"seq": N, "started": PID} or {"seq": N, "refused": TEXT}, in answer
  server -> launcher   {"exited": PID, "code": C} when a worker ends (C as Popen's returncode)
  launcher -> server   {"reap": PID} once the launcher has seen that end
A worker stays a zombie until the launcher sends "reap", as a Popen child does until it is
polled, so its pid and process group are not reused while the launcher may still signal them.
The launcher owns both ends of this protocol (the server is its child); the server still checks
every request's shape, so a bad one is refused, never half-run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set

MAX_MESSAGE = 1 << 20          # one request at most: argv and environment (and what the socket takes)
READY_TIMEOUT_S = 600.0        # importing torch on a loaded node can take a minute; not forever
REPLY_TIMEOUT_S = 30.0
LOST_REPORT_S = 5.0            # a worker gone from /proc this long with no report from the server: ended


# ---------------------------------------------------------------------------------------------- which
@dataclasses.dataclass(frozen=True)
class Target:
    """What a forked worker runs: a script (``kind`` "path") or a module ("module"), with its args."""
    kind: str
    name: str
    args: tuple
    unbuffered: bool = False


def forkable(command: Sequence[str], executable: str = sys.executable, which=shutil.which) -> Optional[Target]:
    """The script or module ``command`` runs when it is this interpreter (``executable``, by the same
    path's directory and file) as ``python [-u] SCRIPT ...`` or ``python [-u] -m MODULE ...``;
    None for anything else (other flags, ``-c``, another Python, a shell script): those start
    as a new process."""
    if len(command) < 2:
        return None
    exe = which(command[0])
    if exe is None:
        return None
    try:
        same = (os.path.dirname(os.path.abspath(exe)) == os.path.dirname(os.path.abspath(executable))
                and os.path.samefile(exe, executable))
    except OSError:
        return None
    if not same:
        return None
    rest = list(command[1:])
    unbuffered = rest[0] == "-u"
    if unbuffered:
        rest = rest[1:]
    if not rest:
        return None
    if rest[0] == "-m":
        if len(rest) < 2 or not rest[1] or rest[1].startswith("-"):
            return None
        return Target("module", rest[1], tuple(rest[2:]), unbuffered)
    if rest[0].startswith("-"):
        return None
    return Target("path", rest[0], tuple(rest[1:]), unbuffered)


def main_path(target: Target, cwd: str) -> str:
    """The directory the interpreter puts first on sys.path to run ``target`` in ``cwd``: the
    script's own, symlinks resolved, for `python SCRIPT`; ``cwd`` itself for `python -m MODULE`
    (neither under -P or PYTHONSAFEPATH: the caller checks sys.flags.safe_path)."""
    if target.kind == "module":
        return cwd
    return os.path.dirname(os.path.realpath(os.path.join(cwd, target.name)))


def check_request(msg: object, fds: Sequence[int]) -> Optional[str]:
    """Why a spawn request is refused (None: it is well formed)."""
    if len(fds) != 2:
        return f"expected 2 descriptors (stdout, stderr), got {len(fds)}"
    if not isinstance(msg, dict) or set(msg) != {"seq", "argv", "env", "cwd"}:
        return "expected an object with seq, argv, env and cwd"
    argv, env, cwd = msg["argv"], msg["env"], msg["cwd"]
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) and "\0" not in a for a in argv)):
        return "argv must be a non-empty list of strings"
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) and k and "=" not in k
                                          and "\0" not in k + v for k, v in env.items())):
        return "env must map variable names to strings"
    if not (isinstance(cwd, str) and os.path.isabs(cwd) and "\0" not in cwd):
        return "cwd must be an absolute path"
    if forkable(argv) is None:
        return f"not a command this interpreter runs: {argv[:3]}"
    return None


# ---------------------------------------------------------------------------------------------- launcher side
class ForkServerError(RuntimeError):
    """The fork server could not start, preload, or fork a worker; the message says which and why."""


class ForkedProcess:
    """A worker forked by the server: the parts of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, server: "ForkServer", pid: int):
        self.pid = pid
        self.stdout = self.stderr = None
        self.returncode: Optional[int] = None
        self._server = server
        self._ended = threading.Event()
        self._reaped = False

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> Optional[int]:
        if not self._ended.is_set():
            return None
        if not self._reaped:   # seen: its pid may now be reused, as after Popen.poll
            self._reaped = True
            self._server.reap(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Its exit status, once the server reported it; also when the server can no longer report
        (it died, or it is stopped and the worker is gone from /proc): then SIGKILL's."""
        deadline = None if timeout is None else time.monotonic() + timeout
        gone_since = None
        while not self._ended.wait(0.1):
            if self._server.dead or self._server.proc.poll() is not None:
                self._end(-signal.SIGKILL)
                break
            if not _alive(self.pid):
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > LOST_REPORT_S:
                    self._end(-signal.SIGKILL)
                    break
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
        return self.poll()


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


class ForkServer:
    """The launcher's handle on its fork server: start it, wait until it preloaded, fork workers."""

    def __init__(self, modules: Sequence[str], env: Mapping[str, str], *, command: Sequence[str],
                 wrap=lambda cmd: cmd):
        """``command``: the worker command the server forks (as ``spawn`` gets it, run in this
        process's directory); the modules are imported from where it would import them."""
        self.modules = tuple(modules)
        target = forkable(command)
        if target is None:
            raise ForkServerError(f"not a command this interpreter runs: {list(command[:3])}")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE + 4096)
        # What the kernel granted (net.core.wmem_max caps it): a larger request would not go through.
        self.max_request = min(MAX_MESSAGE, ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2 - 1024)
        self._sock = ours
        self.proc = subprocess.Popen(
            # By path, not -m: the server imports nothing of elastic (nor gRPC) before it forks.
            wrap([sys.executable, os.path.abspath(__file__), str(theirs.fileno()),
                  main_path(target, os.getcwd()), *self.modules]),
            env=dict(env), stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self._lock = threading.Lock()              # one request in flight
        self._send_lock = threading.Lock()
        self._seq = 0
        self._replies: "queue.Queue[dict]" = queue.Queue()
        self._children: Dict[int, ForkedProcess] = {}
        self._children_lock = threading.Lock()
        self._ready = threading.Event()
        self._error = ""
        self.dead = False
        threading.Thread(target=self._read, name="elastic-forkserver", daemon=True).start()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Until the server imported the modules (ForkServerError if it could not, or took too long),
        or ``cancelled()`` (a signal to the launcher)."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.05):
            if cancelled():
                return
            if time.monotonic() > deadline:
                raise ForkServerError(f"--preload: importing {','.join(self.modules)} took over {timeout_s:g} s")
        if self._error:
            raise ForkServerError(f"--preload: {self._error}")

    def spawn(self, command: Sequence[str], env: Mapping[str, str], cwd: Optional[str] = None,
              output: Optional[int] = None) -> ForkedProcess:
        """Forks a worker running ``command`` with ``env`` in ``cwd`` (absolute; default: this
        process's); its stdout and stderr are new pipes, or both the descriptor ``output`` (a log
        file's, say: as Popen's ``stdout=f, stderr=STDOUT``), which stays the caller's."""
        self.wait_ready()
        with self._lock:
            self._seq += 1
            seq = self._seq
            data = json.dumps({"seq": seq, "argv": list(command), "env": dict(env),
                               "cwd": os.path.abspath(cwd or os.getcwd())}).encode()
            if len(data) > self.max_request:
                raise ForkServerError(f"the worker's command and environment take {len(data)} bytes, more than "
                                      f"the {self.max_request} one request to the fork server may")
            if self.dead:
                raise ForkServerError("the fork server is gone")
            pipes = [os.pipe(), os.pipe()] if output is None else []   # (read, write): stdout, stderr
            try:
                try:
                    with self._send_lock:
                        socket.send_fds(self._sock, [data], [w for _, w in pipes] or [output, output])
                except OSError as e:
                    raise ForkServerError(f"cannot reach the fork server: {e.strerror or e}") from None
                reply = self._reply(seq)
            except BaseException:
                for r, _ in pipes:
                    os.close(r)
                raise
            finally:
                for _, w in pipes:
                    os.close(w)
        if "started" not in reply:
            for r, _ in pipes:
                os.close(r)
            raise ForkServerError(f"the fork server refused the worker: {reply.get('refused')}")
        child = reply["child"]
        if pipes:
            child.stdout, child.stderr = (os.fdopen(r, "rb") for r, _ in pipes)
        return child

    def _reply(self, seq: int) -> dict:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            try:
                reply = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ForkServerError(f"the fork server did not answer in {REPLY_TIMEOUT_S:g} s") from None
            if reply.get("seq") == seq or "gone" in reply:
                return reply
            # The answer to a request that timed out: that worker has no owner; end it.
            if "child" in reply:
                _killpg(reply["child"].pid)

    def reap(self, pid: int) -> None:
        try:
            with self._send_lock:
                self._sock.send(json.dumps({"reap": pid}).encode())
        except OSError:
            pass   # the server is gone: so is the zombie

    def _read(self) -> None:
        try:
            while True:
                data = self._sock.recv(MAX_MESSAGE)
                if not data:
                    break
                msg = json.loads(data)
                if "ready" in msg or "error" in msg:
                    self._error = str(msg.get("error", ""))
                    self._ready.set()
                elif "started" in msg:
                    child = ForkedProcess(self, int(msg["started"]))
                    with self._children_lock:
                        self._children[child.pid] = child
                    self._replies.put({"seq": msg["seq"], "started": child.pid, "child": child})
                elif "refused" in msg:
                    self._replies.put(msg)
                elif "exited" in msg:
                    with self._children_lock:
                        child = self._children.pop(int(msg["exited"]), None)
                    if child is not None:
                        child._end(int(msg["code"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        # The server is gone (or speaks nonsense: then it goes now), and its workers with it: their
        # parent-death signal is SIGKILL.
        self.dead = True
        if self.proc.poll() is None:
            self.proc.kill()
        if not self._ready.is_set():
            self._error = f"the fork server exited while importing {','.join(self.modules)} (see its error above)"
            self._ready.set()
        self._replies.put({"gone": True, "refused": "the fork server is gone"})
        with self._children_lock:
            children, self._children = list(self._children.values()), {}
        for child in children:
            child._end(-signal.SIGKILL)

    def close(self) -> None:
        """Ends the server (its workers are stopped by then); reaps it."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------------------------- server side
def _send(sock: socket.socket, msg: dict) -> None:
    sock.send(json.dumps(msg).encode())


def serve(fd: int, path0: str, modules: List[str]) -> int:
    """Imports ``modules`` with ``path0`` first on sys.path (where the workers' command imports
    from), then forks a worker for each request the launcher sends on ``fd``."""
    import importlib

    if not sys.flags.safe_path:   # in place of this file's directory, which `python FILE` put there
        sys.path[0] = path0
    sock = socket.socket(fileno=fd)
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as e:   # noqa: BLE001 - any failure of the import is the user's answer
            _send(sock, {"error": f"cannot import {name}: {type(e).__name__}: {e}"})
            return 1
    if threading.active_count() > 1:
        _send(sock, {"error": f"importing {','.join(modules)} started Python threads "
                              f"({', '.join(t.name for t in threading.enumerate()[1:])}): a process with "
                              "threads cannot fork workers safely; preload fewer modules"})
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    poller = select.poll()   # not select(): the launcher's descriptor numbers may be above 1024
    poller.register(sock, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    live: Set[int] = set()        # forked, end not yet reported
    reported: Set[int] = set()    # end reported, waiting for the launcher's "reap"
    _send(sock, {"ready": True})
    while True:
        events = dict(poller.poll())
        if wake_r in events:
            os.read(wake_r, 4096)
        _report_ends(sock, live, reported)
        if sock.fileno() not in events:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        except OSError:
            return 0
        if not data:
            return 0   # the launcher is gone; our workers follow us (parent-death signal)
        try:
            msg = json.loads(data)
        except ValueError:
            msg = None
        if isinstance(msg, dict) and set(msg) == {"reap"} and not fds:
            if msg["reap"] in reported:
                reported.discard(msg["reap"])
                os.waitpid(msg["reap"], 0)
            continue
        seq = msg.get("seq") if isinstance(msg, dict) else None
        why = check_request(msg, fds)
        pid = -1
        if why is None:
            try:
                pid = os.fork()
            except OSError as e:   # EAGAIN (a pids limit), ENOMEM: this worker cannot start; the others go on
                why = f"fork failed: {e.strerror or e}"
        if pid == 0:
            _child(msg, forkable(msg["argv"]), fds, server=os.getppid(), closing=(sock.fileno(), wake_r, wake_w))
        for f in fds:
            os.close(f)
        if why is not None:
            _send(sock, {"seq": seq, "refused": why})
            continue
        live.add(pid)
        _send(sock, {"seq": seq, "started": pid})


def _report_ends(sock: socket.socket, live: Set[int], reported: Set[int]) -> None:
    """Reports each worker that ended, leaving it a zombie (WNOWAIT) until the launcher says "reap"."""
    for pid in list(live):
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            info = None
            live.discard(pid)
        if info is None or info.si_pid == 0:
            continue
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        live.discard(pid)
        reported.add(pid)
        _send(sock, {"exited": pid, "code": code})


def _child(msg: dict, target: Target, fds: Sequence[int], server: int, closing: Sequence[int]) -> None:
    """In the forked worker: become the process ``msg["argv"]`` would have started, run it, exit."""
    code = 1
    try:
        os.setsid()   # its own process group, as Popen(start_new_session=True) gives the others
        try:
            import ctypes
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG: die with the server
        except (OSError, AttributeError):
            pass
        if os.getppid() != server:   # the server died before the line above
            os._exit(137)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for f in closing:
            os.close(f)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for f in (devnull, *fds):
            os.close(f)
        os.environ.clear()
        os.environ.update(msg["env"])
        os.chdir(msg["cwd"])
        replaced = _fresh_stdio(target.unbuffered or bool(os.environ.get("PYTHONUNBUFFERED")))  # noqa: F841
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:   # as a new process: its own seed, not the server's copied state
            numpy_random.seed()
        code = _run(target)
    except BaseException:   # noqa: BLE001 - a failure before the script ran still ends this process
        import traceback
        traceback.print_exc()
    os._exit(code)


def _fresh_stdio(unbuffered: bool) -> list:
    """sys.stdout and sys.stderr on the worker's pipes, buffered as the interpreter would set them
    up. Returns the server's own streams they replace: the caller keeps them until it exits, so
    they are never finalised in a worker (that would close fd 1 or 2)."""
    import io

    replaced = []
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        replaced.append(old)
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        setattr(sys, name, io.TextIOWrapper(binary, encoding=old.encoding, errors=old.errors,
                                            line_buffering=not unbuffered and fd == 2, write_through=unbuffered))
    return replaced


def _run(target: Target) -> int:
    """Runs the script or module as the interpreter's main program would (in a fresh ``__main__``
    module), and returns the exit status the interpreter would have had (an uncaught exception
    prints its traceback: 1)."""
    import atexit
    import gc
    import runpy
    import types

    main = types.ModuleType("__main__")
    main.__annotations__ = {}   # the interpreter's __main__ has one from the start
    sys.modules["__main__"] = main
    code = 0
    try:
        if not sys.flags.safe_path:
            sys.path[0] = main_path(target, os.getcwd())
        if target.kind == "module":
            sys.argv = ["-m", *target.args]
            runpy._run_module_as_main(target.name)   # what `python -m` runs, in __main__'s own namespace
        else:
            sys.argv = [target.name, *target.args]
            from importlib.machinery import SourceFileLoader
            with open(target.name, "rb") as f:
                source = f.read()
            main.__dict__.update(__file__=target.name, __cached__=None, __builtins__=__builtins__,
                                 __loader__=SourceFileLoader("__main__", target.name))
            exec(compile(source, target.name, "exec"), main.__dict__)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt as e:
        sys.excepthook(type(e), e, _from_the_script(e))
        code = -signal.SIGINT   # the interpreter ends by SIGINT itself (below)
    except BaseException as e:   # noqa: BLE001 - as the interpreter: print it, exit 1
        sys.excepthook(type(e), e, _from_the_script(e))
        code = 1
    # What the interpreter does on its way out: wait for non-daemon threads, run atexit handlers
    # (logging's flush among them), clear __main__'s names as its module teardown does (so an
    # open file the script never closed is flushed and closed in order), collect, flush.
    for step in (getattr(threading, "_shutdown", None), atexit._run_exitfuncs,
                 lambda: _clear_namespace(sys.modules["__main__"].__dict__), gc.collect):
        try:
            if step is not None:
                step()
        except BaseException:   # noqa: BLE001 - one failing step must not skip the next
            sys.excepthook(*sys.exc_info())
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    return code


def _clear_namespace(names: dict) -> None:
    """As the interpreter clears a module at exit: names with one leading underscore first, then
    the rest, each set to None (``__builtins__`` kept)."""
    for first in (True, False):
        for key in list(names):
            if key != "__builtins__" and isinstance(key, str) and (key.startswith("_") == first):
                names[key] = None


def _from_the_script(e: BaseException):
    """``e``'s traceback from the script's first frame on (set on ``e`` too: that is the one
    printed): this module's and runpy's frames above it are not in what `python SCRIPT` prints."""
    ours = (os.path.abspath(__file__), "<frozen runpy>")
    tb = e.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in ours
                              or os.path.basename(tb.tb_frame.f_code.co_filename) == "runpy.py"):
        tb = tb.tb_next
    e.__traceback__ = tb
    return tb


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), sys.argv[2], sys.argv[3:]))
