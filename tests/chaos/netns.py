"""Hosts as network namespaces, for the chaos scenarios that break the network.

    with Network(3) as net:                      # hosts 0..2, each its own namespace
        job.start("w0", prefix=net.prefix(0), ELASTIC_HOST="h0", ELASTIC_RING_HOST=net.address(0))
        net.cut(1) ... net.heal(1)               # pull host 1's cable, plug it back
        net.netem(2, delay_ms=20, jitter_ms=5, loss_pct=1) ... net.clear_netem(2)

Layout: a "switch" namespace holds a Linux bridge (br0, 10.231.88.254/24, where the rendezvous
server listens: see `NsServer`); host i is a namespace whose eth0 (10.231.88.<i+1>) is one end
of a veth pair, the other end (p<i>) a port of the bridge. The switch is a namespace of its
own rather than the root namespace, so nothing of the machine's network is touched: no
address or route of the root namespace, no clash with another run using the same subnet, and
no host firewall on the path (with br_netfilter loaded, bridged frames go through the root
namespace's iptables FORWARD chain, which on a Docker host drops them). Every interface lives
in a namespace of this network, so its (short, fixed) name cannot clash either; the namespace
names carry the pid and a counter. Teardown deletes the namespaces, which destroys the veth
pairs and the bridge with them.

Where the kernel has no tc netem (CONFIG_NET_SCH_NETEM unset, as on the 2-core VM this suite
was written on), a host can be built `wired`: its link is then a pair of TAP devices (eth0 in
the host, p<i> on the bridge) relayed by a small process on the switch (`_wire_main`) that
delays, jitters (FIFO: no reordering) and drops frames in each direction as `netem()` sets.
Cut and heal work the same on both kinds of link.

A cut sets the switch end of the host's veth down: the host's eth0 loses its carrier but keeps
its address and routes, as when a cable is pulled, and no frame passes either way (checked by
tests/chaos/test_partition.py::test_network_cut_and_heal).
"""

from __future__ import annotations

import functools
import itertools
import os
import select
import shutil
import subprocess
import sys
import time
from typing import List, Optional, Sequence

from tests.waiting import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUBNET = "10.231.88"
SWITCH_ADDRESS = f"{SUBNET}.254"
_BRIDGE_MAC = "02:00:0a:e7:58:fe"   # fixed: a bridge's MAC otherwise follows its ports
_ids = itertools.count()


def skip_reason() -> Optional[str]:
    """Why these tests cannot run here (None: they can). CI runs as root with iproute2."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (CI runs as root)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc) to create network namespaces (CI has it)"
    return None


@functools.lru_cache(maxsize=None)
def netem_skip_reason() -> Optional[str]:
    """Why `Network.netem` cannot work here (None: it can): the kernel needs sch_netem
    (CONFIG_NET_SCH_NETEM); probed by adding a netem qdisc in a throwaway namespace."""
    reason = skip_reason()
    if reason is not None:
        return reason
    ns = f"er-probe-{os.getpid()}-{next(_ids)}"
    try:
        _run("ip", "netns", "add", ns)
        p = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                           capture_output=True, text=True, timeout=10)
        if p.returncode != 0:
            return f"this kernel has no tc netem (sch_netem, CONFIG_NET_SCH_NETEM): {p.stderr.strip()}"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _run(*cmd: str) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()}")
    return p.stdout


class Network:
    """`n_hosts` hosts (namespaces) on one bridge; see the module docstring."""

    def __init__(self, n_hosts: int, wired: Sequence[int] = ()):
        if not 1 <= n_hosts <= 250:
            raise ValueError(f"1 <= n_hosts <= 250, got {n_hosts}")
        self._wires: dict = {}
        self._wired = set(wired)
        tag = f"{os.getpid()}-{next(_ids)}"
        self.switch = f"er-sw-{tag}"
        self.hosts: List[str] = [f"er-h{i}-{tag}" for i in range(n_hosts)]
        self.switch_address = SWITCH_ADDRESS
        self._made: List[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        sw = self.switch
        for ns in (sw, *self.hosts):
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", sw, "link", "add", "br0", "address", _BRIDGE_MAC, "type", "bridge")
        _run("ip", "-n", sw, "addr", "add", f"{SWITCH_ADDRESS}/24", "dev", "br0")
        for i, ns in enumerate(self.hosts):
            if i in self._wired:
                self._wires[i] = _Wire(self, i)
            else:
                # Created directly in their namespaces: the names never exist in the root namespace.
                _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", self._port(i),
                     "netns", sw)
            _run("ip", "-n", sw, "link", "set", self._port(i), "master", "br0")
            _run("ip", "-n", sw, "link", "set", self._port(i), "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", sw, "link", "set", "br0", "up")

    # ------------------------------------------------------------------ names
    @staticmethod
    def _port(i: int) -> str:
        return f"p{i}"

    def address(self, i: int) -> str:
        """Host i's address (what its workers bind and announce: ELASTIC_RING_HOST)."""
        self.hosts[i]  # IndexError for a host that does not exist
        return f"{SUBNET}.{i + 1}"

    def prefix(self, i: int) -> List[str]:
        """Command prefix that runs a process on host i (``Job.start(..., prefix=...)``)."""
        return ["ip", "netns", "exec", self.hosts[i]]

    def switch_prefix(self) -> List[str]:
        """Command prefix that runs a process on the switch (e.g. the rendezvous server)."""
        return ["ip", "netns", "exec", self.switch]

    # ------------------------------------------------------------------ faults
    def cut(self, i: int) -> None:
        """Pull host i's cable: its switch port goes down; nothing passes either way."""
        _run("ip", "-n", self.switch, "link", "set", self._port(i), "down")

    def heal(self, i: int) -> None:
        """Plug host i's cable back in (the bridge forwards at once: no STP)."""
        _run("ip", "-n", self.switch, "link", "set", self._port(i), "up")

    def netem(self, i: int, *, delay_ms: float = 0, jitter_ms: float = 0, loss_pct: float = 0) -> None:
        """A bad link for host i: netem on both ends of its veth, so each direction gets
        `delay_ms` ± `jitter_ms` and loses `loss_pct` % of its packets (round trip: twice)."""
        spec: List[str] = []
        if delay_ms:
            spec += ["delay", f"{delay_ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
        if loss_pct:
            spec += ["loss", f"{loss_pct}%"]
        if not spec:
            raise ValueError("netem: give a delay or a loss")
        if i in self._wires:
            self._wires[i].set(delay_ms, jitter_ms, loss_pct)
            return
        for ns, dev in self._ends(i):
            _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "netem", *spec)

    def clear_netem(self, i: int) -> None:
        if i in self._wires:
            self._wires[i].set(0, 0, 0)
            return
        for ns, dev in self._ends(i):
            _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root")

    def qdiscs(self, i: int) -> str:
        """`tc qdisc show` of both ends of host i's link (a wired link: its settings)."""
        if i in self._wires:
            return self._wires[i].settings
        return "".join(_run("tc", "-n", ns, "qdisc", "show", "dev", dev) for ns, dev in self._ends(i))

    def _ends(self, i: int):
        return [(self.hosts[i], "eth0"), (self.switch, self._port(i))]

    # ------------------------------------------------------------------ probing
    def connect_s(self, src: Optional[int], address: str, timeout_s: float = 1.0) -> Optional[float]:
        """Seconds a TCP connect from host `src` (None: the switch) to `address` takes to be
        answered (refused counts: the peer answered), or None if nothing came back in time."""
        prefix = self.switch_prefix() if src is None else self.prefix(src)
        code = ("import socket, sys, time\n"
                "s = socket.socket(); s.settimeout(float(sys.argv[2])); t = time.monotonic()\n"
                "try:\n    s.connect((sys.argv[1], 9))\n"
                "except ConnectionRefusedError:\n    pass\n"
                "except OSError:\n    print('none'); sys.exit()\n"
                "print(time.monotonic() - t)\n")
        out = _run(*prefix, sys.executable, "-S", "-c", code, address, str(timeout_s)).strip()
        return None if out == "none" else float(out)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Deletes every namespace made (their interfaces go with them); safe to call twice."""
        for wire in self._wires.values():
            wire.close()
        self._wires = {}
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self._made = []

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Wire:
    """Host i's link as two TAP devices relayed by `_wire_main` on the switch (see the module
    docstring); both are made there, then one moves into the host as its eth0."""

    def __init__(self, net: Network, i: int):
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.settings = "wire delay 0 ms jitter 0 ms loss 0 %"
        self.proc = subprocess.Popen([*net.switch_prefix(), sys.executable, "-m", "tests.chaos.netns", "wire",
                                      f"e{i}", net._port(i)], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            self._expect("ready")
            _run("ip", "-n", net.switch, "link", "set", f"e{i}", "netns", net.hosts[i])
            _run("ip", "-n", net.hosts[i], "link", "set", f"e{i}", "name", "eth0")
        except BaseException:
            self.close()
            raise

    def _expect(self, word: str, timeout_s: float = 10.0) -> None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline().strip() if ready else "(nothing)"
        if line != word:
            raise RuntimeError(f"wire relay: expected {word!r}, got {line!r} (exit {self.proc.poll()})")

    def set(self, delay_ms: float, jitter_ms: float, loss_pct: float) -> None:
        self.proc.stdin.write(f"{delay_ms} {jitter_ms} {loss_pct}\n")
        self.proc.stdin.flush()
        self._expect("ok")
        self.settings = (f"wire delay {delay_ms} ms jitter {jitter_ms} ms loss {loss_pct} %"
                         + (" (netem)" if delay_ms or jitter_ms or loss_pct else ""))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


def _wire_main(a_name: str, b_name: str) -> None:
    """The relay of a wired link: frames from each TAP go to the other after the delay (± the
    jitter, never before an earlier frame of the same direction), unless dropped at the loss
    rate. Settings arrive on stdin as "DELAY_MS JITTER_MS LOSS_PCT" lines, each answered "ok"."""
    import collections
    import fcntl
    import random
    import struct
    import threading

    def tap(name: str) -> int:
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, 0x400454CA, struct.pack("16sH", name.encode(), 0x0002 | 0x1000))  # TUNSETIFF, TAP|NO_PI
        return fd

    fds = (tap(a_name), tap(b_name))
    now = time.monotonic
    cfg = {"delay": 0.0, "jitter": 0.0, "loss": 0.0}

    def direction(src: int, dst: int) -> None:
        queue: collections.deque = collections.deque()
        cond = threading.Condition()

        def read() -> None:
            last = 0.0
            while True:
                frame = os.read(src, 65536)
                if random.random() * 100 < cfg["loss"]:
                    continue
                due = max(last, now() + max(0.0, cfg["delay"] + random.uniform(-cfg["jitter"], cfg["jitter"])))
                last = due
                with cond:
                    queue.append((due, frame))
                    cond.notify()

        def write() -> None:
            while True:
                with cond:
                    while not queue:
                        cond.wait()
                    due, frame = queue.popleft()
                wait = due - now()
                if wait > 0:
                    time.sleep(wait)
                try:
                    os.write(dst, frame)
                except OSError:
                    pass  # the other end is down (a cut): the frame is lost, as on a cable

        for f in (read, write):
            threading.Thread(target=f, daemon=True).start()

    direction(fds[0], fds[1])
    direction(fds[1], fds[0])
    print("ready", flush=True)
    for line in sys.stdin:
        delay_ms, jitter_ms, loss_pct = (float(x) for x in line.split())
        cfg.update(delay=delay_ms / 1000, jitter=jitter_ms / 1000, loss=loss_pct)
        print("ok", flush=True)


class NsServer:
    """`python -m rendezvous serve` on the switch, listening on the bridge address (the same
    command line as tests/rendezvous/rdzv_helpers.ServerProc, run under `ip netns exec`)."""

    def __init__(self, net: Network, tmp_path, *args: str, timeout_s: float = 20.0):
        self.port_file = str(tmp_path / f"port-{time.monotonic_ns()}")
        self.log_path = self.port_file + ".log"
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [*net.switch_prefix(), sys.executable, "-m", "rendezvous", "serve",
             "--host", net.switch_address, "--port", "0", "--port-file", self.port_file, *args],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: os.path.exists(self.port_file) or self.proc.poll() is not None, timeout_s,
                       "the rendezvous server to listen")
            assert self.proc.poll() is None, f"rendezvous server exited: {self.log()}"
            wait_until(lambda: open(self.port_file).read().strip(), 5, "the port file to be written")
        except BaseException:
            self.kill()
            raise
        self.port = int(open(self.port_file).read())
        self.address = f"{net.switch_address}:{self.port}"

    def log(self, tail: int = 4000) -> str:
        """The server's log: its last `tail` characters (0: all of it, for checks on the whole run)."""
        with open(self.log_path, "rb") as f:
            text = f.read().decode(errors="replace")
        return text[-tail:] if tail else text

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def start_on_hosts(job, net: Network, places: dict, **env) -> None:
    """Starts each worker of `places` (worker id -> host index) on its host: inside that
    namespace, host name h<i> (workers of one host share memory), ring on the host's address."""
    for worker, i in places.items():
        job.start(worker, prefix=net.prefix(i), ELASTIC_HOST=f"h{i}", ELASTIC_RING_HOST=net.address(i), **env)


if __name__ == "__main__" and sys.argv[1:2] == ["wire"]:
    _wire_main(*sys.argv[2:4])

__all__: Sequence[str] = ("Network", "NsServer", "netem_skip_reason", "skip_reason", "start_on_hosts", "SWITCH_ADDRESS")
