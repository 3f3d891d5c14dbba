"""A 3-member etcd cluster on loopback for the chaos tests: members can be killed and restarted."""

from __future__ import annotations

import os
import subprocess
from typing import List, Optional

from rendezvous.server.etcd_process import find_etcd, free_port
from tests.waiting import wait_until


class EtcdCluster:
    def __init__(self, data_dir: str, members: int = 3, *, startup_timeout_s: float = 30.0):
        self.data_dir = data_dir
        self.names = [f"m{i}" for i in range(members)]
        self.client_ports = [free_port() for _ in self.names]
        self.peer_ports = [free_port() for _ in self.names]
        self.endpoints = [f"127.0.0.1:{p}" for p in self.client_ports]
        self.initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports))
        self.procs: List[Optional[subprocess.Popen]] = [None] * members
        self._logs = [None] * members
        self.member_ids: dict = {}   # etcd's member id -> index here; fixed for the cluster's life
        try:
            for i in range(members):
                self.start(i, state="new")
            # Every member's id, learned once, so that naming the leader later needs only one live
            # member to answer: not the new leader itself, which may be busy just after an election.
            wait_until(lambda: self._learn_ids() and self.leader() is not None, startup_timeout_s,
                       "the etcd cluster to elect a leader", interval=0.1)
        except BaseException:
            self.stop()
            raise

    def start(self, i: int, state: str = "existing") -> None:
        """Starts member i (again: `state="existing"` rejoins with its data directory)."""
        name, client, peer = self.names[i], self.client_ports[i], self.peer_ports[i]
        self._logs[i] = open(os.path.join(self.data_dir, f"{name}.log"), "ab")
        self.procs[i] = subprocess.Popen(
            [find_etcd(), "--name", name, "--data-dir", os.path.join(self.data_dir, name),
             "--listen-client-urls", f"http://127.0.0.1:{client}",
             "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", self.initial, "--initial-cluster-state", state,
             "--initial-cluster-token", "chaos", "--log-level", "info",
             "--heartbeat-interval", "50", "--election-timeout", "500"],
            stdout=self._logs[i], stderr=subprocess.STDOUT)

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)
        self.procs[i] = None

    def _status(self, i: int):
        """(this member's id, the leader's id or 0, raft index) as member i answers."""
        import etcd3
        from etcd3.etcdrpc import rpc_pb2

        host, port = self.endpoints[i].rsplit(":", 1)
        client = etcd3.client(host, int(port), timeout=1)
        try:
            r = client.maintenancestub.Status(rpc_pb2.StatusRequest(), 1)
            return r.header.member_id, r.leader, r.raftIndex
        finally:
            client.close()

    def _alive(self, i: int) -> bool:
        p = self.procs[i]
        return p is not None and p.poll() is None

    def _learn_ids(self) -> bool:
        for i in range(len(self.procs)):
            if i not in self.member_ids.values() and self._alive(i):
                try:
                    self.member_ids[self._status(i)[0]] = i
                except Exception:  # not answering yet
                    pass
        return len(self.member_ids) == len(self.procs)

    def leader(self) -> Optional[int]:
        """Index of the member that leads, as the live members that answer see it; None while there
        is none or they disagree."""
        leaders = set()
        for i in range(len(self.procs)):
            if not self._alive(i):
                continue
            try:
                leaders.add(self._status(i)[1])
            except Exception:  # not answering (yet)
                continue
        if len(leaders) != 1:
            return None
        return self.member_ids.get(leaders.pop())

    def wait(self, predicate, timeout_s: float, what: str):
        """`wait_until` with every member's state in the error on a timeout."""
        try:
            return wait_until(predicate, timeout_s, what, interval=0.05)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.describe()}") from None

    def describe(self) -> str:
        """Each member as it stands: running or not, its status answer, the end of its log."""
        ids = {i: m for m, i in self.member_ids.items()}
        lines = []
        for i, name in enumerate(self.names):
            answer = "not running"
            if self._alive(i):
                try:
                    member, leader, index = self._status(i)
                    answer = f"member {member:x}, leader {leader:x}, raft index {index}"
                except Exception as e:
                    answer = f"no answer: {type(e).__name__}: {e}"
            lines.append(f"--- etcd {name} (id {ids.get(i, 0):x}): {answer}")
            try:
                with open(os.path.join(self.data_dir, f"{name}.log"), "rb") as f:
                    tail = f.read().decode(errors="replace").splitlines()[-12:]
            except OSError as e:
                tail = [f"(no log: {e})"]
            lines.extend(tail)
        return "\n".join(lines)

    def healthy(self, i: int) -> bool:
        try:
            return self._alive(i) and self._status(i)[1] != 0
        except Exception:
            return False

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        for log in self._logs:
            if log is not None:
                log.close()
