"""Files the tools write — port files, event logs, token files, durable commits — never through
a symbolic link, never creating what a link names, never half-written.

Another user who can write a directory these files go into (a shared /tmp, a group-writable log
directory) can plant a link there before the tool runs; writing through it would truncate, fill
or create whatever the link names, with this user's permissions. So every writer goes through
one of these:

- ``replace(path, data)``: a whole file. Written to a new file that ``mkstemp`` makes in the
  target's directory (O_EXCL: a planted name is never opened) and renamed over the target. The
  rename replaces a link that stands there, never what it names; readers see the old file or
  the whole new one.
- ``open_log(path)``: a file appended to (or started afresh). O_NOFOLLOW, and it must be a
  regular file: a FIFO planted there would block the open, so it is opened non-blocking and
  checked before use.
- ``check_log(path)``: a flag's check that ``open_log`` will work later. It creates nothing.

Errors are ``OSError`` (what the call failed on); ``reason(e)`` says it in words for a flag's
error ("it is a symbolic link (not followed)").
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
from typing import BinaryIO, Callable, Union

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def replace(path: str, data: Union[bytes, Callable[[BinaryIO], None]], *, mode: int = 0o600,
            durable: bool = False) -> None:
    """Makes ``path`` a new regular file holding ``data`` (bytes, or a function that writes to
    the open file), with permissions ``mode``. ``durable``: fsynced, and the rename too."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        dfd = os.open(directory, os.O_RDONLY | _CLOEXEC)
        try:
            os.fsync(dfd)   # the rename itself survives a crash of the machine
        finally:
            os.close(dfd)


def open_log(path: str, *, truncate: bool = False, create: bool = True, mode: int = 0o640) -> int:
    """A descriptor open for appending to ``path`` (emptied first with ``truncate``), created
    with ``mode`` if missing (unless ``create`` is False); ``OSError`` when ``path`` is a
    symbolic link (ELOOP) or not a regular file."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC
    if create:
        flags |= os.O_CREAT
    fd = os.open(path, flags, mode)   # a FIFO without a reader: ENXIO instead of blocking
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "it is not a regular file", path)
        if truncate:
            os.ftruncate(fd, 0)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_log(path: str) -> None:
    """``OSError`` unless ``open_log(path)`` can work: an existing regular file this user may
    append to, or a missing one in a directory this user may write. Creates nothing."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(errno.ENOENT, f"No such file or directory ({parent} does not exist)") from None
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, f"Permission denied ({parent} is not writable by this user)") from None
        return
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
    os.close(open_log(path, create=False))


def reason(e: OSError) -> str:
    """Why ``e`` happened, in words for a flag's error message."""
    if e.errno == errno.ELOOP:
        return "it is a symbolic link (not followed)"
    if e.errno == errno.ENXIO:   # a FIFO nobody reads, opened non-blocking
        return "it is not a regular file"
    return e.strerror or str(e)
