"""Durable commits on disk: a checksummed file per commit, the newest two kept, a corrupt one
skipped, and a directory no other user can write.

A file, ``elastic-commit-<commit>-<position>.ckpt``, ``<position>`` the training step the commit
holds as the state counts it (``step-70``, ``epoch-3-batch-10``; absent when the state has no such
counter; ``elastic.runtime.commit_watch.position``), all integers little-endian:

| offset | bytes | what |
| --- | --- | --- |
| 0 | 8 | ``MAGIC`` |
| 8 | 4 | format version (``VERSION``) |
| 12 | 8 | commit step, signed |
| 20 | 8 | payload length n |
| 28 | n | the state, in ``elastic.ring.serialization``'s format (which cannot run code when read) |
| 28 + n | 32 | SHA-256 of bytes [0, 28 + n) |

Written to a temporary file in the same directory, fsynced, renamed into place and the
directory fsynced: a file either is complete or does not exist, even across a crash of the
machine. A truncated or corrupted one (a full disk, a bad block, a hand-edited file) fails the
length or the checksum; reading then logs its path and reason, moves it aside (``.corrupt``)
and takes the one before.

Anyone who can write the directory decides what every worker resumes from, so it must be owned
by this user and writable by no one else, and no directory above it may let another user
replace it (group/other write without the sticky bit).

``DurableWriter`` writes them on a thread of its own, so the training thread never waits for
the disk: a commit hands over its in-memory snapshot and goes on. One write at a time; a
commit that finds the previous one still running waits for it (a bounded time, logged), and a
failed write is logged and the next durable commit tries again.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import re
import stat
import struct
import threading
import time
import weakref
from typing import Any, List, Optional, Tuple

from rendezvous.common import files

from elastic.ring import serialization

log = logging.getLogger("elastic")

MAGIC = b"\x89elckpt\n"
VERSION = 1
KEEP = 2  # durable commits kept: the newest, and the one before in case the newest is unreadable

_HEADER = struct.Struct("<8sIqQ")
_DIGEST = 32
_NAME = re.compile(r"elastic-commit-(\d{1,19})(?:-[a-z0-9-]{1,80})?\.ckpt")
_LEGACY_NAME = "elastic-commit.pt"  # pickle files of earlier versions: never read
# At the end of elastic.run and at process exit, how long the write in flight may take to finish:
# less than the 30 s the launcher gives workers to exit after the job succeeded.
FINISH_TIMEOUT_S = 20.0
IDLE_EXIT_S = 30.0  # a writer thread with nothing to write for this long ends
NOTABLE_WAIT_S = 0.1  # a commit that waited this long for the previous write says so (a warning)


def file_name(step: int, position: str = "") -> str:
    """The file of durable commit ``step``, which holds the training step ``position`` (``step 70``)."""
    slug = re.sub(r"[^a-z0-9]+", "-", position.lower()).strip("-")[:80].strip("-")
    return f"elastic-commit-{step:012d}-{slug}.ckpt" if slug else f"elastic-commit-{step:012d}.ckpt"


def _describe(st: os.stat_result) -> str:
    return f"mode {stat.filemode(st.st_mode)} ({stat.S_IMODE(st.st_mode):04o}), owner uid {st.st_uid}"


def check_directory(directory: str) -> None:
    """Raises ``PermissionError`` naming ``directory`` and its mode when another user could
    write it or replace it; ``NotADirectoryError`` when it is not a directory."""
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"checkpoint directory {directory} is not a directory")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise PermissionError(f"checkpoint directory {directory} ({_describe(st)}) is not owned by this user "
                              f"(uid {uid}): its owner decides what the job resumes from; use a directory of "
                              "your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"checkpoint directory {directory} ({_describe(st)}) can be written by other "
                              f"users, who could plant the commit the job resumes from; run chmod go-w {directory} "
                              "or use another directory")
    # Owners of the directories above are trusted (an administrator's mount point, say); a
    # directory above that others may write without the sticky bit lets them swap this one.
    path = os.path.realpath(directory)
    while True:
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
        pst = os.stat(path)
        if pst.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not pst.st_mode & stat.S_ISVTX:
            raise PermissionError(f"checkpoint directory {directory}: the directory above it, {path} "
                                  f"({_describe(pst)}), can be written by other users and has no sticky bit, so "
                                  "they could replace the checkpoint directory; use a directory under one only "
                                  "you can write")


def prepare_directory(directory: str) -> None:
    """Creates ``directory`` (mode 0700) if needed and checks it (``check_directory``)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    check_directory(directory)


def write(directory: str, step: int, state: Any, position: str = "") -> str:
    """Writes ``state`` as the durable commit ``step``, atomically; keeps the newest ``KEEP``
    files and returns the new file's path. ``TypeError`` if the state cannot be carried."""
    encoded = serialization.encode(state)
    header = _HEADER.pack(MAGIC, VERSION, step, encoded.nbytes)
    digest = encoded.hash_into(hashlib.sha256(header))
    path = os.path.join(directory, file_name(step, position))

    def write_to(f) -> None:
        f.write(header)
        for chunk in encoded.chunks:
            f.write(chunk)
        f.write(digest.digest())

    # A temporary file in the directory, fsynced, renamed over the name (never through a link
    # standing there) and the directory fsynced: complete or absent, even after a machine crash.
    files.replace(path, write_to, mode=0o600, durable=True)
    for _, old in _commits(directory)[KEEP:]:
        try:
            os.unlink(old)
        except OSError as e:
            log.warning("could not remove the old durable commit %s: %s", old, e.strerror)
    return path


def numbered(directory: str, pattern: "re.Pattern[str]") -> List[Tuple[int, str]]:
    """(number, path) of the entries of ``directory`` whose whole name ``pattern`` matches, its
    first group the number: the durable commits there, newest first."""
    found = []
    for name in os.listdir(directory):
        m = pattern.fullmatch(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found, reverse=True)


def _commits(directory: str) -> List[Tuple[int, str]]:
    """(step, path) of the durable commit files in ``directory``, newest first."""
    return numbered(directory, _NAME)


def read_file(path: str, expected_step: Optional[int] = None) -> Tuple[int, Any]:
    """(step, state) from one durable commit file; ``ValueError`` saying what is wrong with it."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _HEADER.size + _DIGEST:
            raise ValueError(f"{size} bytes, shorter than a header and a checksum (truncated?)")
        head = f.read(_HEADER.size)
        if len(head) != _HEADER.size:
            raise ValueError(f"ended after {len(head)} bytes (truncated while being read?)")
        magic, version, step, length = _HEADER.unpack(head)
        if magic != MAGIC:
            raise ValueError("not an elastic-ring durable commit (no magic number)")
        if version != VERSION:
            raise ValueError(f"format version {version}, this elastic-ring reads version {VERSION}")
        if size != _HEADER.size + length + _DIGEST:
            raise ValueError(f"{size} bytes, but the header announces {_HEADER.size + length + _DIGEST} (truncated?)")
        if expected_step is not None and step != expected_step:
            raise ValueError(f"holds commit {step}, but its name says commit {expected_step}")
        body = bytearray(length + _DIGEST)
        view = memoryview(body)
        got = 0
        while got < len(body):
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"ended after {_HEADER.size + got} bytes (truncated while being read?)")
            got += n
    digest = hashlib.sha256(head)
    digest.update(view[:length])
    if digest.digest() != bytes(view[length:]):
        raise ValueError("checksum mismatch (the file is corrupt)")
    return step, serialization.loads(view[:length])


def read_latest(directory: str) -> Optional[Tuple[int, Any, str]]:
    """(step, state, path) of the newest readable durable commit in ``directory``; None when
    there is none. A file that cannot be read is logged with its path and reason, moved aside
    and the one before it taken; ``ValueError`` when commits exist and none can be read."""
    check_directory(directory)
    legacy = os.path.join(directory, _LEGACY_NAME)
    if os.path.exists(legacy):
        log.warning("ignoring %s: a durable commit of an earlier elastic-ring in pickle format, which is never "
                    "loaded (it could run code); move it away to silence this", legacy)
    failures = []
    for step, path in _commits(directory):
        try:
            got, state = read_file(path, expected_step=step)
        except (OSError, ValueError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            failures.append((path, reason))
            log.error("durable commit %s cannot be used: %s; trying the one before", path, reason)
            continue
        # Only once one is usable are the newer ones moved aside (kept for inspection, never
        # read again); with none usable, all stay where they are for the operator.
        for bad, _ in failures:
            try:
                os.replace(bad, bad + ".corrupt")
            except OSError as e:
                log.warning("could not move %s aside: %s", bad, e.strerror)
        return got, state, path
    if failures:
        raise ValueError(f"no usable durable commit in {directory}: "
                         + "; ".join(f"{path}: {reason}" for path, reason in failures))
    return None


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        where = f" ({e.filename})" if e.filename else ""
        return f"{e.strerror}{where}"
    return f"{type(e).__name__}: {e}"


class DurableWriter:
    """Writes the durable commits of one directory on a background thread, one at a time.

    ``submit(step, snapshot)`` hands over a snapshot and returns at once unless the previous
    write is still running: then it waits for it, at most ``wait_s`` (logging the time waited),
    and past that leaves this commit unwritten (logged). While the writer ``holds()`` a
    snapshot, its owner must not change it: ``State`` copies its next commit into fresh
    buffers rather than into the one being written. A failed write (a full disk, an I/O error,
    a directory that went away) is logged with the path and the reason and changes nothing
    else; the next submitted commit is written as usual. ``finish()`` waits for the write in
    flight, with a deadline; every writer still busy at process exit is finished too.

    ``write_file`` (``write``) is what writes one file; tests replace it to slow the disk down.
    """

    write_file = staticmethod(write)

    def __init__(self, directory: str):
        self.directory = directory
        self._cond = threading.Condition()
        self._job: Optional[Tuple[int, Any, str]] = None  # (step, snapshot, position) handed over, not yet written
        self.submitted: Optional[int] = None   # the last commit handed over (written or being written)
        self._thread: Optional[threading.Thread] = None
        self.written: Optional[int] = None  # step of the last commit written
        self.failed: Optional[Tuple[int, str]] = None  # (step, reason) of the last failure, until a write succeeds
        me = weakref.ref(self)   # neither hook keeps a writer its State dropped
        # Runs before the interpreter stops daemon threads: a completed job's last durable commit
        # reaches the disk even when the script ends right after its last commit.
        atexit.register(lambda: me() is not None and me().finish())
        # A forked child has no writer thread: nothing of the parent's is in flight there.
        os.register_at_fork(after_in_child=lambda: me() is not None and me()._forget_after_fork())

    def holds(self, snapshot: Any) -> bool:
        """Whether ``snapshot`` is handed over and not yet written (its buffers are being read)."""
        with self._cond:
            return self._job is not None and self._job[1] is snapshot

    def pending(self) -> Optional[int]:
        """The step of the commit handed over and not yet written, or None."""
        with self._cond:
            return None if self._job is None else self._job[0]

    def submit(self, step: int, snapshot: Any, wait_s: float, position: str = "") -> bool:
        """Hands ``snapshot`` (commit ``step``) to the writer; False (logged) when the previous
        write was still running after ``wait_s`` seconds and this commit is not written."""
        started = time.monotonic()
        with self._cond:
            if self._job is not None:
                previous = self._job[0]
                if not self._wait_idle(started + wait_s):
                    log.warning("durable commit %d not written: the write of commit %d to %s is still running "
                                "after %.1f s; the in-memory commit stands and the next durable commit tries again",
                                step, previous, self.directory, time.monotonic() - started)
                    return False
                waited = time.monotonic() - started
                # A disk slower than the commit interval is worth a line; a few ms of overlap are not.
                log.log(logging.WARNING if waited >= NOTABLE_WAIT_S else logging.DEBUG,
                        "durable commit %d waited %.1f s for the write of commit %d to %s", step, waited, previous,
                        self.directory)
            self._job = (step, snapshot, position)
            self.submitted = step
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="elastic-durable-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def finish(self, timeout_s: Optional[float] = None) -> bool:
        """Waits for the write in flight; False (logged) when it is still running after
        ``timeout_s`` (default ``FINISH_TIMEOUT_S``)."""
        timeout_s = FINISH_TIMEOUT_S if timeout_s is None else timeout_s
        started = time.monotonic()
        with self._cond:
            if self._job is None:
                return True
            step = self._job[0]
            if self._wait_idle(started + timeout_s):
                return True
        log.error("durable commit %d was still being written to %s after %.1f s; the newest complete durable "
                  "commit there is an earlier one", step, self.directory, time.monotonic() - started)
        return False

    def _wait_idle(self, deadline: float) -> bool:
        while self._job is not None:  # called holding the lock
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._cond.wait(left)
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                idle_until = time.monotonic() + IDLE_EXIT_S
                while self._job is None:
                    left = idle_until - time.monotonic()
                    if left <= 0:
                        # Idle: the thread ends (the next submit starts another), so a State
                        # dropped by its owner leaves no thread behind.
                        self._thread = None
                        return
                    self._cond.wait(left)
                step, snapshot, position = self._job
            path = os.path.join(self.directory, file_name(step, position))
            try:
                self.write_file(self.directory, step, snapshot, position)
            except BaseException as e:  # noqa: B036 - a thread that died here would hold the job forever
                log.error("durable commit %d could not be written to %s: %s; the in-memory commit stands and the "
                          "next durable commit tries again", step, path, _reason(e))
                failed: Optional[Tuple[int, str]] = (step, _reason(e))
            else:
                if self.failed is not None:
                    log.warning("durable commit %d written to %s (after the write of commit %d failed)", step, path,
                                self.failed[0])
                failed = None
            with self._cond:
                if failed is None:
                    self.written = step
                self.failed = failed
                self._job = None  # from here on the snapshot's buffers are free to reuse
                del snapshot
                self._cond.notify_all()

    def _forget_after_fork(self) -> None:
        self._cond = threading.Condition()
        self._job, self._thread = None, None


__all__ = ["MAGIC", "VERSION", "KEEP", "FINISH_TIMEOUT_S", "file_name", "check_directory", "prepare_directory",
           "write", "read_file", "read_latest", "DurableWriter"]
