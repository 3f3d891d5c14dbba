"""A real Slurm cluster on one machine, for the tests of `elastic-run` under `srun`.

    with SlurmCluster(tmp_dir, nodes=4) as c:     # slurmctld + node1..node4, each its own slurmd
        job = c.sbatch(script_path)               # the real sbatch; returns the job id
        c.wait_job(job, "COMPLETED")              # scontrol show job, polled with a deadline
        c.fail_node(2)                            # SIGKILL every process of node2: slurmd, steps, workers
        c.restore_node(2)                         # a new slurmd; Slurm returns the node to service

Debian's `slurm-wlm` and `munge` (installed by .ci/run as root). Each node is a network namespace of
tests/chaos/netns.Network (node i+1 is host i, 10.231.88.<i+1>, on a bridge) and a UTS namespace whose
hostname is the node's name, so `hostname`, SLURMD_NODENAME and the name Slurm knows agree; a mount
namespace gives it an /etc/hosts naming every node, as a cluster's DNS would. slurmctld runs on the
switch (10.231.88.254, hostname "ctl"), where the client commands (sbatch, scontrol, scancel) run too.

The traps of Slurm in namespaces, and what this does about them:
* `ip netns exec` mounts a fresh /sys, which hides /sys/fs/cgroup, and slurmd then refuses to start
  ("Unable to initialize cgroup plugin"): processes enter the network namespace with `nsenter` instead.
* No cgroups are used: proctrack/linuxproc (a step's processes are its task's descendants) and
  task/none; no accounting (no slurmdbd: `scontrol` shows what an admin checks, not `sacct`).
* Every slurmd gets its own spool directory and pid file (%n), and `-N` its node name; one munged
  serves all of them through its socket (a file: network namespaces do not separate it).
* The hardware slurmd sees is the machine's: SlurmdParameters=config_overrides makes the nodes' CPUs
  the configured ones. SlurmdTimeout is short so that a killed node is declared DOWN in seconds,
  cred_expire so that a requeued job may start again after 11 s (cred_expire + 1), not Slurm's 121, and
  sched_interval so that the scheduler's main loop, which is what starts it then, runs every 2 s
  rather than every 60 (with the default, the requeue test took anywhere from 58 to 105 s).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from typing import Dict, List, Optional, Sequence

from tests.chaos.netns import Network, skip_reason as netns_skip_reason
from tests.waiting import wait_until

BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo", "munged", "munge", "nsenter",
            "unshare")
SLURMD_TIMEOUT_S = 4   # a node whose slurmd stops answering is DOWN after about 3-4 times this
# A step's credential lifetime, and how long a requeued job waits (Slurm's default 120 s; its least, 5):
# ample for nodes on one machine, whose slurmd takes a step's credential as soon as it is made.
CRED_EXPIRE_S = 10
SCHED_INTERVAL_S = 2   # how often the main scheduling loop tests every pending job (default 60 s)


def skip_reason() -> Optional[str]:
    """Why a Slurm cluster cannot be built here (None: it can)."""
    reason = netns_skip_reason()
    if reason is not None:
        return reason
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return (f"Slurm and munge are not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge "
                "(.ci/run does it when run as root)")
    return None


class SlurmCluster:
    def __init__(self, root: str, nodes: int = 4):
        self.root = root
        self.names = [f"node{i + 1}" for i in range(nodes)]
        self.conf = os.path.join(root, "slurm.conf")
        self.munge_socket = os.path.join(root, "munge", "munge.socket")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self._procs: Dict[str, subprocess.Popen] = {}
        self.net = Network(nodes)
        try:
            self._write_files()
            self._start_munge()
            self._start("ctl", self.net.switch, ["slurmctld", "-D", "-i"])
            for i in range(nodes):
                self._start_slurmd(i)
            wait_until(lambda: self.node_states() == {n: "idle" for n in self.names}, 60,
                       f"every node to be idle: {self._states_or_log()}")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ set-up
    def _write_files(self) -> None:
        os.makedirs(os.path.join(self.root, "munge"), mode=0o700)
        os.makedirs(os.path.join(self.root, "ctld"))
        for name in self.names:
            os.makedirs(os.path.join(self.root, "spool", name))
        with open(os.path.join(self.root, "munge", "munge.key"), "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(os.path.join(self.root, "munge", "munge.key"), 0o600)
        with open(os.path.join(self.root, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n" + f"{self.net.switch_address} ctl\n"
                    + "".join(f"{self.net.address(i)} {n}\n" for i, n in enumerate(self.names)))
        with open(os.path.join(self.root, "plugstack.conf"), "w"):
            pass
        r = self.root
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=elastictest
SlurmctldHost=ctl({self.net.switch_address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={r}/ctld
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
PlugStackConfig={r}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval={SCHED_INTERVAL_S}
MpiDefault=none
SwitchType=switch/none
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout={SLURMD_TIMEOUT_S}
MessageTimeout=5
KillWait=5
InactiveLimit=0
MinJobAge=600
MailProg=/bin/true
NodeName=DEFAULT CPUs=2 RealMemory=500 State=UNKNOWN
""" + "".join(f"NodeName={n} NodeAddr={self.net.address(i)}\n" for i, n in enumerate(self.names))
                    + "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n")

    def _start_munge(self) -> None:
        d = os.path.join(self.root, "munge")
        self._procs["munged"] = subprocess.Popen(
            ["munged", "--foreground", "--force", f"--key-file={d}/munge.key", f"--socket={self.munge_socket}",
             f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed", f"--log-file={d}/munged.log"],
            stdin=subprocess.DEVNULL, stdout=open(f"{d}/munged.out", "wb"), stderr=subprocess.STDOUT)
        wait_until(lambda: os.path.exists(self.munge_socket) or self._procs["munged"].poll() is not None, 15,
                   "munged to listen")
        if self._procs["munged"].poll() is not None:
            raise RuntimeError(f"munged exited {self._procs['munged'].returncode}: {_tail(f'{d}/munged.out')}")

    def _start(self, name: str, netns: str, command: List[str]) -> None:
        """`command` in `netns`, in its own UTS namespace (hostname `name`) and mount namespace (our
        /etc/hosts); entered with nsenter, not `ip netns exec`, which would hide the cgroup mounts."""
        shell = f"mount --bind {self.root}/hosts /etc/hosts && hostname {name} && exec \"$@\""
        self._procs[name] = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{netns}", "unshare", "--mount", "--uts", "sh", "-c", shell, name, *command],
            env=self.env, stdin=subprocess.DEVNULL, stdout=open(os.path.join(self.root, f"{name}.out"), "ab"),
            stderr=subprocess.STDOUT, start_new_session=True)

    def _start_slurmd(self, i: int) -> None:
        self._start(self.names[i], self.net.hosts[i], ["slurmd", "-D", "-N", self.names[i]])

    # ------------------------------------------------------------------ commands
    def run(self, *command: str, timeout: float = 30, check: bool = True, **env: str) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, scontrol, ...) on the switch, where slurmctld listens."""
        p = subprocess.run(["nsenter", f"--net=/run/netns/{self.net.switch}", *command], env={**self.env, **env},
                           capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: exit {p.returncode}: {p.stderr.strip() or p.stdout.strip()}")
        return p

    def on_node(self, node: str, *command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A command run on `node`, in its slurmd's namespaces (network, hostname, mounts), e.g.
        `scontrol listpids`, which asks the node's own step daemons."""
        slurmd = self._procs[node].pid
        return subprocess.run(["nsenter", "-t", str(slurmd), "--net", "--uts", "--mount", *command], env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def sbatch(self, script: str, *options: str, args: Sequence[str] = (), **env: str) -> str:
        """The job id of `sbatch OPTIONS SCRIPT ARGS`, submitted with `env` added to this environment."""
        out = self.run("sbatch", "--parsable", *options, script, *args, **env).stdout.strip()
        return out.split(";")[0]

    def node_states(self) -> Dict[str, str]:
        p = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split() for line in p.stdout.splitlines() if line.strip()) if p.returncode == 0 else {}

    def job(self, job_id: str) -> Dict[str, str]:
        """`scontrol show job -o`: the job's fields, as an admin reads them."""
        return _fields(self.run("scontrol", "show", "job", "-o", job_id).stdout)

    def steps(self, job_id: str) -> List[Dict[str, str]]:
        """`scontrol show step -o` for the job's running steps."""
        out = self.run("scontrol", "show", "step", "-o", job_id, check=False).stdout
        return [_fields(line) for line in out.splitlines() if line.startswith("StepId=")]

    def wait_job(self, job_id: str, states, timeout: float) -> Dict[str, str]:
        """Waits until the job's state is one of `states` (e.g. "COMPLETED"); returns its fields."""
        states = (states,) if isinstance(states, str) else tuple(states)
        return wait_until(lambda: (lambda j: j if j.get("JobState") in states else None)(self.job(job_id)), timeout,
                          f"job {job_id} to be {'/'.join(states)} (it is {self.job(job_id).get('JobState')})",
                          interval=0.25)

    # ------------------------------------------------------------------ faults
    def node_pids(self, node: str) -> List[int]:
        out = subprocess.run(["ip", "netns", "pids", self.net.hosts[self.names.index(node)]], capture_output=True,
                             text=True, timeout=10).stdout
        return [int(p) for p in out.split()]

    def processes(self, node: str, needle: str) -> List[int]:
        """Pids on `node` whose command line contains `needle`."""
        found = []
        for pid in self.node_pids(node):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if needle.encode() in f.read():
                        found.append(pid)
            except OSError:
                pass
        return found

    def fail_node(self, node: str) -> None:
        """The node dies: SIGKILL to every process on it (its slurmd, step daemons, launchers, workers)."""
        for pid in self.node_pids(node):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: not self.node_pids(node), 10, f"every process of {node} to be gone")
        p = self._procs.pop(node, None)
        if p is not None:
            p.wait(10)

    def restore_node(self, node: str, timeout: float = 60) -> None:
        """A fresh slurmd on `node`; Slurm returns it to service (ReturnToService=2) once it registers."""
        if node not in self._procs:
            self._start_slurmd(self.names.index(node))
        wait_until(lambda: self.node_states().get(node) == "idle", timeout,
                   f"{node} to be idle again: {self._states_or_log()}")

    def heal(self, timeout: float = 60) -> None:
        """Every node back and idle, no job left: the state each test starts from."""
        for job_id in self.run("squeue", "-h", "-o", "%i").stdout.split():
            self.run("scancel", job_id, check=False)
        for node in self.names:
            if node not in self._procs or self._procs[node].poll() is not None:
                self._procs.pop(node, None)
                self.restore_node(node, timeout)
        wait_until(lambda: self.node_states() == {n: "idle" for n in self.names}, timeout,
                   f"every node to be idle: {self._states_or_log()}")

    # ------------------------------------------------------------------ diagnostics and teardown
    def logs(self, tail: int = 3000) -> str:
        parts = []
        for name in ["slurmctld.log", *(f"slurmd-{n}.log" for n in self.names)]:
            parts.append(f"--- {name}\n{_tail(os.path.join(self.root, name), tail)}")
        return "\n".join(parts)

    def _states_or_log(self) -> str:
        return f"{self.node_states()}\n{self.logs(1500)}"

    def close(self) -> None:
        """SIGKILL: every process of every node (slurmd, steps, workers), slurmctld and munged; then the
        namespaces go. Nothing of the cluster is kept, so nothing needs a graceful stop."""
        for ns in [*getattr(self.net, "hosts", []), getattr(self.net, "switch", "")]:
            if not ns:
                continue
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self._procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)
        self._procs = {}
        self.net.close()

    def __enter__(self) -> "SlurmCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fields(text: str) -> Dict[str, str]:
    """`scontrol show -o` output ("Key=Value Key=Value ...") as a dict."""
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")[-n:]
    except OSError as e:
        return f"({e.strerror})"
