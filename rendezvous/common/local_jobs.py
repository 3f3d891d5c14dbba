"""The jobs `elastic-run` serves on this machine for this user, so `elastic-rendezvous status` finds them.

An `elastic-run` with its embedded server writes one small JSON file per job into a directory of
this user's (``$XDG_RUNTIME_DIR/elastic-ring/jobs``, else ``/tmp/elastic-ring-<uid>/jobs``; 0700):
the job id, the server's address, the path of its token file (the token itself stays in the
launcher's private directory) and the launcher's pid. `status` without ``--server`` reads them.
Another user who can write ``/tmp`` could plant a directory or a file there: the directory must be
this user's and no one else's to write, each file a regular file of this user's, and its fields
are checked like any input; a file that fails is skipped with the reason, never trusted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from typing import Callable, List, Mapping, Optional, Tuple

from rendezvous.common import files

MAX_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class LocalJob:
    job_id: str
    server: str        # HOST:PORT
    token_file: str    # absolute path
    pid: int           # the launcher's


def directory(env: Optional[Mapping[str, str]] = None, uid: Optional[int] = None) -> str:
    env = os.environ if env is None else env
    uid = os.getuid() if uid is None else uid
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "elastic-ring", "jobs")
    return os.path.join("/tmp", f"elastic-ring-{uid}", "jobs")


def _private(path: str) -> Optional[str]:
    """Why ``path`` is not a directory only this user can write (None: it is)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory (a link or a file stands there)"
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not this user"
    if st.st_mode & 0o022:
        return "writable by others"
    return None


def _make_private(path: str) -> None:
    for d in (os.path.dirname(path), path):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        why = _private(d)
        if why is not None:
            raise OSError(f"{d}: {why}; remove it, or set XDG_RUNTIME_DIR to a directory of your own")


def announce(job: LocalJob, env: Optional[Mapping[str, str]] = None) -> str:
    """Writes ``job``'s file (0600, never through a link); returns its path for ``withdraw``."""
    where = directory(env)
    _make_private(where)
    path = os.path.join(where, f"{job.pid}.json")
    files.replace(path, json.dumps(dataclasses.asdict(job)).encode(), mode=0o600)
    return path


def withdraw(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def parse(data: bytes) -> LocalJob:
    """A job file's fields, checked (ValueError saying what is wrong)."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"over {MAX_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("not JSON") from None
    if not isinstance(doc, dict) or set(doc) != {f.name for f in dataclasses.fields(LocalJob)}:
        raise ValueError("not a job file")
    job_id, server, token_file, pid = doc["job_id"], doc["server"], doc["token_file"], doc["pid"]
    if not (isinstance(job_id, str) and 0 < len(job_id) <= 128 and isinstance(server, str)
            and 0 < len(server) <= 300 and server.rpartition(":")[2].isdigit()
            and isinstance(token_file, str) and os.path.isabs(token_file) and len(token_file) <= 4096
            and type(pid) is int and pid > 0):
        raise ValueError("a field is out of range")
    return LocalJob(job_id, server, token_file, pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False   # another user's process under a recycled pid: not this user's launcher
    return True


def found(env: Optional[Mapping[str, str]] = None,
          alive: Callable[[int], bool] = _alive) -> Tuple[List[LocalJob], List[str]]:
    """This user's running jobs on this machine, and a reason for every file passed over."""
    where = directory(env)
    why = _private(where)
    if why == "missing":
        return [], []
    if why is not None:
        return [], [f"{where}: {why}: not read"]
    jobs, skipped = [], []
    for name in sorted(os.listdir(where)):
        path = os.path.join(where, name)
        if not name.endswith(".json"):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                    raise ValueError("not a regular file of this user's")
                job = parse(f.read(MAX_BYTES + 1))
        except (OSError, ValueError) as e:
            skipped.append(f"{path}: {e}")
            continue
        if alive(job.pid):
            jobs.append(job)
    return jobs, skipped
