"""Another local user holding many idle connections to a port: what `/metrics` must survive.

``other_user()`` makes (once, as root) a system user that owns nothing here; ``Flood`` runs, as
that user, a plain Python process that opens ``n`` TCP connections to HOST:PORT (a few at a time,
as fast as a server accepts them), sends nothing, and reopens the ones the server closes, until it
is stopped. Its first line on stdout says how
many it opened. Tests that need it are skipped, with their reason, when not run as root.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import threading

import pytest

from tests.waiting import wait_until

USER = "elastic-flood"

_FLOODER = r"""
import errno, resource, select, socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

def connect():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    s.connect_ex((host, port))
    return s

# A few at a time: a burst beyond the server's accept backlog would only wait in SYN retries.
conns = []
while len(conns) < n:
    conns += [connect() for _ in range(min(4, n - len(conns)))]
    time.sleep(0.002)
print(f"opened {len(conns)}", flush=True)
reopened = 0
while True:
    time.sleep(0.2)
    for i, s in enumerate(conns):
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            gone = True   # refused, reset or timed out while connecting
        else:
            try:
                gone = s.recv(1, socket.MSG_PEEK) == b""
            except BlockingIOError:
                gone = False
            except OSError as e:
                gone = e.errno != errno.ENOTCONN   # still connecting: the server has not accepted it yet
        if gone:
            s.close()
            conns[i] = connect()
            reopened += 1
            if reopened % 4 == 0:
                time.sleep(0.002)
    print(f"reopened {reopened}", flush=True)
"""


def require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the flood comes from another local user, made with useradd")


def other_user() -> pwd.struct_passwd:
    """A system user with no home and no shell, made once."""
    require_root()
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                       check=True, capture_output=True)
        return pwd.getpwnam(USER)


class Flood:
    def __init__(self, host: str, port: int, n: int = 1100):
        user = other_user()
        # The system interpreter: the flooder needs no package, and the other user may not read ours.
        python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
        self.proc = subprocess.Popen([python, "-c", _FLOODER, host, str(port), str(n)], user=user.pw_uid,
                                     group=user.pw_gid, extra_groups=[], cwd="/", stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.uid = user.pw_uid
        line = self.proc.stdout.readline()   # bounded: the flooder prints it after n connects or dies
        if not line.startswith("opened "):
            self.stop()
            raise AssertionError(f"the flooder did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.opened = int(line.split()[1])
        self.rounds = 0      # times the flooder went over its connections, reopening closed ones
        self.reopened = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("reopened "):
                self.reopened = int(line.split()[1])
                self.rounds += 1

    def wait_rounds(self, rounds: int, timeout: float = 30) -> None:
        """Until the flood has been held (and topped up) ``rounds`` more times."""
        target = self.rounds + rounds
        wait_until(lambda: self.rounds >= target or self.proc.poll() is not None, timeout, "the flood to go on")
        assert self.proc.poll() is None, f"the flooder died: {self.proc.stderr.read()[-2000:]}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def connections_from(uid: int, port: int) -> int:
    """Established TCP connections to local ``port`` whose client end belongs to ``uid``."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            remote_port = int(cols[2].rsplit(":", 1)[1], 16)
            if cols[3] == "01" and remote_port == port and int(cols[7]) == uid:
                count += 1
    return count


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
