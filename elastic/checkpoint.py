"""Durable commits on disk: a checksummed file per commit, the newest two kept, a corrupt one
skipped, and a directory no other user can write.

A file, ``elastic-commit-<step>.ckpt`` (all integers little-endian):

| offset | bytes | what |
| --- | --- | --- |
| 0 | 8 | ``MAGIC`` |
| 8 | 4 | format version (``VERSION``) |
| 12 | 8 | commit step, signed |
| 20 | 8 | payload length n |
| 28 | n | the state, in ``elastic.serialization``'s format (which cannot run code when read) |
| 28 + n | 32 | SHA-256 of bytes [0, 28 + n) |

Written to a temporary file in the same directory, fsynced, renamed into place and the
directory fsynced: a file either is complete or does not exist, even across a crash of the
machine. A truncated or corrupted one (a full disk, a bad block, a hand-edited file) fails the
length or the checksum; reading then logs its path and reason, moves it aside (``.corrupt``)
and takes the one before.

Anyone who can write the directory decides what every worker resumes from, so it must be owned
by this user and writable by no one else, and no directory above it may let another user
replace it (group/other write without the sticky bit).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import struct
import tempfile
from typing import Any, List, Optional, Tuple

from . import serialization

log = logging.getLogger("elastic")

MAGIC = b"\x89elckpt\n"
VERSION = 1
KEEP = 2  # durable commits kept: the newest, and the one before in case the newest is unreadable

_HEADER = struct.Struct("<8sIqQ")
_DIGEST = 32
_NAME = re.compile(r"elastic-commit-(\d{1,19})\.ckpt")
_LEGACY_NAME = "elastic-commit.pt"  # pickle files of earlier versions: never read


def file_name(step: int) -> str:
    return f"elastic-commit-{step:012d}.ckpt"


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


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash of the machine
    finally:
        os.close(fd)


def write(directory: str, step: int, state: Any) -> str:
    """Writes ``state`` as the durable commit ``step``, atomically; keeps the newest ``KEEP``
    files and returns the new file's path. ``TypeError`` if the state cannot be carried."""
    encoded = serialization.encode(state)
    header = _HEADER.pack(MAGIC, VERSION, step, encoded.nbytes)
    digest = hashlib.sha256(header)
    for chunk in encoded.chunks:
        digest.update(chunk)
    path = os.path.join(directory, file_name(step))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".commit-")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            for chunk in encoded.chunks:
                f.write(chunk)
            f.write(digest.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic
        _fsync_directory(directory)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    for _, old in _commits(directory)[KEEP:]:
        try:
            os.unlink(old)
        except OSError as e:
            log.warning("could not remove the old durable commit %s: %s", old, e.strerror)
    return path


def _commits(directory: str) -> List[Tuple[int, str]]:
    """(step, path) of the durable commit files in ``directory``, newest first."""
    found = []
    for name in os.listdir(directory):
        m = _NAME.fullmatch(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found, reverse=True)


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


__all__ = ["MAGIC", "VERSION", "KEEP", "file_name", "check_directory", "prepare_directory", "write", "read_file",
           "read_latest"]
