"""--host-discovery-script: run the script, parse its horovodrun-style ``host[:slots]`` lines.

The launcher uses the slots listed for its own host to decide how many local workers to run;
the other hosts are only reported (this launcher starts no remote processes: run one
``elastic-run --rendezvous ...`` on each of them).
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from typing import Callable, Dict, Iterable, Optional

_LINE = re.compile(r"^\s*([^\s:#]+)(?::(\d+))?\s*$")


class DiscoveryError(RuntimeError):
    pass


def parse_hosts(text: str) -> Dict[str, int]:
    """``host[:slots]`` per line (slots default 1; blank lines and ``#`` comments ignored)."""
    hosts: Dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0]
        if not line.strip():
            continue
        m = _LINE.match(line)
        if not m:
            raise DiscoveryError(f"line {n}: {line.strip()!r} is not host[:slots]")
        hosts[m.group(1)] = hosts.get(m.group(1), 0) + int(m.group(2) or 1)
    return hosts


def run_script(path: str, timeout_s: float = 10.0) -> Dict[str, int]:
    try:
        done = subprocess.run([path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"{path} did not finish within {timeout_s:g} s") from None
    except OSError as e:
        raise DiscoveryError(f"{path}: {e.strerror}") from None
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip().splitlines()
        raise DiscoveryError(f"{path} exited with status {done.returncode}" + (f": {err[-1]}" if err else ""))
    return parse_hosts(done.stdout.decode(errors="replace"))


def local_slots(hosts: Dict[str, int], names: Iterable[str]) -> int:
    """Slots listed for this host under any of its names."""
    return sum(slots for host, slots in hosts.items() if host in set(names))


class DiscoveryPoller:
    """Runs the script every ``interval_s`` in a background thread; ``latest()`` hands over a new
    host list once. A failing run keeps the last list (and is reported once per distinct error)."""

    def __init__(self, path: str, interval_s: float, note: Callable[[str], None]):
        self.path, self.interval_s, self._note = path, interval_s, note
        self._lock = threading.Lock()
        self._latest: Optional[Dict[str, int]] = None
        self._error = ""
        self._thread = threading.Thread(target=self._loop, name="elastic-run-discovery", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.interval_s)
            try:
                hosts, error = run_script(self.path), ""
            except DiscoveryError as e:
                hosts, error = None, str(e)
            with self._lock:
                if hosts is not None:
                    self._latest = hosts
                if error and error != self._error:
                    self._note(f"discovery failed, keeping the last host list: {error}")
                self._error = error

    def latest(self) -> Optional[Dict[str, int]]:
        with self._lock:
            hosts, self._latest = self._latest, None
        return hosts
