"""The launcher: start and keep this host's workers of a job (`elastic-run`, elastic/launch/).

One launcher per host. It starts the embedded rendezvous server unless given --rendezvous,
spawns the local workers (each in its own process group), prefixes their output with their
worker id, respawns the ones killed by a signal (with backoff, --max-restarts per slot), and
follows the job through the Status RPC: it reports worlds and recoveries, ends with the job
(exit 0 when it completed and every local worker ended well, see elastic/launch/outcome.py; 1
with a one-line reason otherwise), and on Ctrl-C/SIGTERM drains every worker before it exits.
Flags: elastic/launch/flags.py. With --metrics-port it serves its workers' metrics
(elastic/launch/host_metrics.py); with --events it writes one JSON line per event it sees
(rendezvous/common/event_log.py): workers started, exited and respawned, worlds formed, recoveries with
their durations, graceful leaves, the job's end.

Graceful leave: a worker sent SIGTERM leaves the job at its next commit and exits 0 (the
runtime's side is elastic.runtime.preemption). A worker of the job that exits 0 while the job still
runs has left: it is reported as "left (preempted)" and not respawned. Draining (this launcher's
SIGTERM/SIGINT, or a slot the discovery script takes away) sends SIGTERM to the worker and
SIGKILL to its process group after --preempt-grace plus --stop-timeout; a launcher with
--rendezvous whose workers all left on its SIGTERM exits 0: the job goes on elsewhere.

Everything it learns about the job (worlds, ranks, the end) comes from Status answers, through the
same public client `elastic-rendezvous status` uses (rendezvous.client.status_client.StatusClient); nothing a
worker prints decides anything.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import Dict, List, Optional, Sequence

import grpc

from rendezvous.common.channel import channel_credentials, is_loopback
from rendezvous.common.event_log import EventLog
from rendezvous.client.status_client import JobStatusInfo, StatusClient, StatusError, StatusFailure

from elastic.launch.flags import LaunchConfig, UsageError, parse
from elastic.launch.discovery import DiscoveryError, DiscoveryPoller, local_slots, run_script
from elastic.launch.embedded import EmbeddedServer, EmbeddedServerFailed
from elastic.launch.environment import fork_server_env, spawn_env
from elastic.launch.forkserver import ForkServer, ForkServerError
from elastic.launch.host_metrics import WorkerMetrics
from elastic.launch.outcome import WorkerEnd, completion_failure
from elastic.launch.procs import (Output, Worker, describe_exit, plan_exit, raise_open_files_limit, signal_of,
                                  stdout_streams, stop_all, with_parent_death_signal)
from elastic.launch.report import Reporter
from elastic.launch.signals import StopSignals
from elastic.launch.slurm import TOKEN_FILE, Announcement, server_answers, wait_for_announcement
from elastic.launch.straggler_watch import StragglerWatch, host_cooling
from elastic.runtime.errors import DIVERGED_EXIT

POLL_S = 0.05            # reap workers / check signals
STATUS_EVERY_S = 0.2     # ask the rendezvous for the job's status
SUCCESS_GRACE_S = 30.0   # after the job succeeded, how long local workers may take to exit
FAILED_GRACE_S = 5.0     # after the job failed, how long local workers may take to exit on their own
RECENT_EVENTS = 16       # job events each status poll asks for (who left cleanly, on any host)
REMOTE_END_GRACE_S = 2.0  # the embedded server outlives other hosts' workers by this: 10 of their status polls


class LaunchFailed(RuntimeError):
    """The job (or this launcher's part of it) failed; the message is the one-line reason."""

    exit_code = 1


class JobBelowMinNp(LaunchFailed):
    """The rendezvous failed the job: its world stayed below --min-np for --elastic-timeout (the only
    way a job fails there). Its own exit status, so that a batch script can requeue the job."""

    exit_code = 3


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Launcher:
    def __init__(self, cfg: LaunchConfig, output: Output):
        self.cfg, self.out = cfg, output
        self.workers: Dict[int, Worker] = {}        # slot -> its latest incarnation
        self.all_workers: List[Worker] = []
        self.spawns: Dict[int, int] = {}            # slot -> incarnations started
        self.failures: Dict[int, int] = {}          # slot -> respawns used
        self.outvoted: Dict[int, int] = {}          # slot -> times its worker was outvoted (DIVERGED_EXIT)
        self.respawn_at: Dict[int, float] = {}      # slot -> when to start it again
        self.succeeded: set = set()                 # slots whose worker exited 0 (or left)
        self.ends: List[WorkerEnd] = []             # how each incarnation ended, in that order
        self.target = cfg.np                        # local workers wanted
        self.server: Optional[EmbeddedServer] = None
        self.forkserver: Optional[ForkServer] = None   # --preload
        self.fork_workers = True                        # until the fork server fails once
        self.status: Optional[StatusClient] = None
        self.view: Optional[JobStatusInfo] = None
        self.reporter = Reporter(time.monotonic())
        self.last_failure = ""
        self.signum: Optional[int] = None
        self.signals = StopSignals()
        self.min_np, self.max_np = cfg.min_np, cfg.max_np
        self.discovery: Optional[DiscoveryPoller] = None
        self._last_hosts: Optional[Dict[str, int]] = None
        self._addresses: Sequence[str] = cfg.rendezvous
        self._token, self._token_file = cfg.token, cfg.token_file   # the embedded server's, once it runs
        self.announcement: Optional[Announcement] = None            # under srun, on the batch host
        self.events = EventLog(None)                # --events, opened in _run
        self.metrics: Optional[WorkerMetrics] = None   # --metrics-port, started in _run
        self._exits_noted: set = set()              # worker ids whose worker_exited is written
        self.stragglers = StragglerWatch(cfg.stragglers.policy, cfg.host)

    # ------------------------------------------------------------------ entry
    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        try:
            code = self._run()
            self._shutdown(code, "completed")
            return code
        except Interrupted as e:
            name = signal.Signals(e.signum).name
            alive = [w for w in self.all_workers if w.alive]
            self.out.note(f"{name}: draining {len(alive)} worker(s): each leaves the job at its next commit "
                          f"(SIGKILL after --preempt-grace {self.cfg.preempt_grace:g} s + --stop-timeout "
                          f"{self.cfg.stop_timeout:g} s; Ctrl-C again kills them at once)")
            left = self._drain(alive, name)
            if alive and left == len(alive) and not self.cfg.embedded:
                self._shutdown(0, f"every worker left gracefully on {name}")
                self.out.note(f"every worker left job {self.cfg.job_id} gracefully on {name}; it goes on without "
                              f"host {self.cfg.host}")
                return 0
            self._shutdown(128 + e.signum, f"stopped by {name}")
            self.out.note(f"stopped by {name}")
            return 128 + e.signum
        except LaunchFailed as e:
            self._shutdown(e.exit_code, str(e))
            self.out.note(f"error: {e}")
            return e.exit_code
        except BaseException:
            self._shutdown(None, "launcher error")   # a bug here must not leave workers behind; the traceback follows
            raise

    def _on_signal(self, signum, frame) -> None:
        self.signals.record(signum, time.monotonic())
        if self.signum is None:
            self.signum = signum

    def _tell_echo(self) -> None:
        line = self.signals.echo_line(signal.Signals(self.signum).name if self.signum else "signal")
        if line:
            self.out.note(line)

    def _check_signal(self) -> None:
        if self.signum is not None:
            raise Interrupted(self.signum)

    def _drain(self, workers: Sequence[Worker], why: str) -> int:
        """Asks ``workers`` to leave the job and waits for them (a second signal: SIGKILL now);
        returns how many left gracefully (exited 0)."""
        deadline = time.monotonic() + self.cfg.preempt_grace + self.cfg.stop_timeout
        for w in workers:
            w.drain(deadline)
        left = 0
        pending = list(workers)
        while pending:
            for w in list(pending):
                code = w.poll()
                if code is None:
                    continue
                pending.remove(w)
                w.handled = True
                self._note_exit(w, code)
                rank = self.reporter.rank_of(w.worker_id)
                self.ends.append(WorkerEnd(w.worker_id, rank, code, stopped=True, left=code == 0))
                if code == 0:
                    left += 1
                    w.left = True
                    self.reporter.note_left(w.worker_id)
                    self._event("preempted", worker_id=w.worker_id, slot=w.slot, why=f"{why} to elastic-run")
                    self.out.note(f"{self._label(w)} left (preempted: {why} to elastic-run)")
                else:
                    self.out.note(f"{self._label(w)} {describe_exit(code)} while draining")
            if not pending:
                break
            self._tell_echo()
            if time.monotonic() >= deadline or self.signals.hurry:
                for w in pending:
                    self.out.note(f"{self._label(w)} did not leave" + (" within the grace; killing it"
                                  if not self.signals.hurry else "; killing it (signalled again)"))
                    w.signal_group(signal.SIGKILL)
                break
            time.sleep(POLL_S)
        return left

    def _shutdown(self, code: Optional[int], reason: str) -> None:
        # Every step runs whatever failed before it: the embedded server's directory (its token)
        # and the metrics socket's must go on every way out.
        try:
            stop_all(self.all_workers, self.cfg.stop_timeout, hurry=lambda: self.signals.hurry)
            for w in self.all_workers:
                self._note_exit(w, w.proc.returncode)
        finally:
            try:
                if self.forkserver is not None:
                    self.forkserver.close()
                if self.announcement is not None:
                    self.announcement.withdraw()
            finally:
                try:
                    if self.server is not None:
                        self.server.stop()
                finally:
                    if self.status is not None:
                        self.status.close()
                    if self.metrics is not None:
                        self.metrics.close()
        self._tell_echo()
        view = self.view
        self._event("job_finished", exit_code=code, reason=reason,
                    phase=view.phase if view is not None else None,
                    recoveries=len(self.reporter.recoveries))
        self.events.close()

    def _event(self, event: str, **fields) -> None:
        view = self.view
        self.events.emit(event, job_id=self.cfg.job_id, world_version=view.world_version if view is not None else None,
                         host=self.cfg.host, **fields)

    def _note_exit(self, w: Worker, code: Optional[int]) -> None:
        """A worker process ended: its worker_exited event (once), and its metrics series go."""
        if w.worker_id in self._exits_noted:
            return
        self._exits_noted.add(w.worker_id)
        if self.metrics is not None:
            self.metrics.detach(w.worker_id)
        sig = signal_of(code) if code is not None else None
        try:
            sig_name = signal.Signals(sig).name if sig is not None else None
        except ValueError:
            sig_name = f"signal {sig}"
        self._event("worker_exited", worker_id=w.worker_id, slot=w.slot, pid=w.pid,
                    rank=self.reporter.rank_of(w.worker_id),
                    code=code if sig is None else None, signal=sig_name, stopped=w.stopping,
                    seconds=round((w.ended_at or time.monotonic()) - w.started_at, 3))

    # ------------------------------------------------------------------ main loop
    def _run(self) -> int:
        cfg = self.cfg
        try:
            self.events = EventLog(cfg.events)
        except ValueError as e:   # checked at parse time; the directory may have gone since
            raise LaunchFailed(str(e)) from None
        if cfg.metrics_port is not None:
            try:
                self.metrics = WorkerMetrics(cfg.metrics_host, cfg.metrics_port)
            except OSError as e:
                raise LaunchFailed(f"--metrics-port {cfg.metrics_port}: cannot serve metrics on "
                                   f"{cfg.metrics_host}: {e.strerror or e}") from None
            self.out.info(f"metrics of this host's workers on http://{_url_host(cfg.metrics_host)}:{self.metrics.port}"
                          "/metrics")
        if cfg.preload:   # it imports while the rendezvous starts
            self.forkserver = ForkServer(cfg.preload, fork_server_env(os.environ, cfg), command=cfg.command,
                                         wrap=with_parent_death_signal)
        if cfg.embedded:
            self.server = EmbeddedServer(cfg.port, cfg.elastic_timeout,
                                         lambda line: self.out.line("err", None, line.encode()),
                                         host=cfg.embedded_host, job_id=cfg.job_id)
            try:
                self._addresses = (self.server.wait_ready(cancelled=lambda: self.signum is not None),)
            except EmbeddedServerFailed as e:
                raise LaunchFailed(str(e)) from None
            self._check_signal()
            self.out.info(f"rendezvous server for job {cfg.job_id} on {self._addresses[0]} (embedded)")
            # A path, not the token: the file is this user's alone (another launcher of the same
            # user may join with --rendezvous ADDRESS --token-file PATH).
            self.out.info(f"its token is in {self.server.token_file} (readable by this user only)")
            self._token, self._token_file = self.server.token, self.server.token_file
        if cfg.slurm_role:
            self._slurm_rendezvous()
        token = self._token
        try:
            credentials = channel_credentials(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
        except ValueError as e:   # checked at parse time; a file may have gone since
            raise LaunchFailed(str(e)) from None
        if cfg.slurm_role == "head":
            self.out.note("note: the embedded rendezvous server has no TLS: its token and the job's ring secret cross "
                          "the cluster network in clear text (for TLS, run elastic-rendezvous serve --tls-cert and "
                          "give --rendezvous and --tls-ca)")
        elif (token and credentials is None and not cfg.slurm_role
              and not all(is_loopback(a.rpartition(":")[0]) for a in self._addresses)):
            self.out.note(f"warning: the rendezvous token goes to {','.join(self._addresses)} in clear text; "
                          "give --tls-ca (servers started with --tls-cert)")
        self.status = StatusClient(self._addresses, token, credentials)
        self._check_job()
        if cfg.host_discovery_script:
            try:
                self._apply_hosts(run_script(cfg.host_discovery_script))
            except DiscoveryError as e:
                raise LaunchFailed(f"--host-discovery-script: {e}") from None
            self.discovery = DiscoveryPoller(cfg.host_discovery_script, cfg.discovery_interval, self.out.note)
            self.discovery.start()
        if cfg.omp_num_threads is not None:
            self.out.info(f"OMP_NUM_THREADS={cfg.omp_num_threads} for every worker, as torchrun sets it (each of "
                          "several workers on a host would otherwise start a thread per core); set OMP_NUM_THREADS "
                          "to choose")
        if self.forkserver is not None:
            began = time.monotonic()
            try:
                self.forkserver.wait_ready(cancelled=lambda: self.signum is not None)
            except ForkServerError as e:
                raise LaunchFailed(str(e)) from None
            self._check_signal()
            self.out.info(f"preloaded {','.join(cfg.preload)} in {time.monotonic() - began:.1f} s: workers are forked "
                          f"from its process (pid {self.forkserver.proc.pid})")
        self._scale()
        next_status = 0.0
        while True:
            self._check_signal()
            now = time.monotonic()
            self._reap(now)
            if now >= next_status:
                # Faster while a local worker has no rank yet: the launcher's lines about it
                # (a failure, a recovery) should name its rank, and only Status gives it.
                unranked = any(w.alive and self.reporter.rank_of(w.worker_id) is None
                               and now - w.started_at < 60 for w in self.workers.values())
                next_status = now + (POLL_S if unranked else STATUS_EVERY_S)
                code = self._follow_job(now)
                if code is not None:
                    return code
            if self.discovery is not None:
                hosts = self.discovery.latest()
                if hosts is not None:
                    self._apply_hosts(hosts)
            self._respawn_due(now)
            code = self._local_end()
            if code is not None:
                return code
            time.sleep(POLL_S)

    def _slurm_rendezvous(self) -> None:
        """Under srun without --rendezvous: the batch host's launcher announces its embedded server to
        the job's other nodes; theirs wait for it and join (elastic/launch/slurm.py)."""
        cfg = self.cfg
        try:
            if cfg.slurm_role == "head":
                self.announcement = Announcement(cfg.announce_dir, self._addresses[0], self._token,
                                                 alive=server_answers)
                self.out.note(f"announced it to the job's other nodes in {cfg.announce_dir}")
                return
            self.out.note(f"waiting for the batch host {cfg.slurm.head} to announce the rendezvous server in "
                          f"{cfg.announce_dir}")
            found = wait_for_announcement(cfg.announce_dir, cfg.slurm.head, cfg.connect_timeout,
                                          cancelled=lambda: self.signum is not None)
        except ValueError as e:
            raise LaunchFailed(str(e)) from None
        self._check_signal()
        self._addresses, self._token = (found[0],), found[1]
        self._token_file = os.path.join(cfg.announce_dir, TOKEN_FILE)
        self.out.note(f"rendezvous server for job {cfg.job_id} on {found[0]} (embedded, on {cfg.slurm.head})")

    def _check_job(self) -> None:
        """Reachability, and agreement with a job that already exists on the server."""
        cfg = self.cfg
        where = ",".join(self._addresses)
        try:
            view = self.status.wait_reachable(cfg.job_id, timeout_s=cfg.connect_timeout,
                                              cancelled=lambda: self.signum is not None)
        except StatusError as e:
            self._check_signal()
            refused = e.refused()
            if refused is not None:
                raise LaunchFailed(refusal_line(refused, cfg)) from None
            raise LaunchFailed(f"cannot reach the rendezvous server at {where}: {e}") from None
        if view is None:
            return
        if view.terminal:
            raise LaunchFailed(f"job {cfg.job_id} on {where} already finished ({view.phase}: {view.reason}); "
                               "use another --job-id")
        if (cfg.min_np_given and cfg.min_np != view.min_np) or (cfg.max_np_given and cfg.max_np != view.max_np):
            raise LaunchFailed(f"job {cfg.job_id} runs with --min-np {view.min_np} --max-np {view.max_np}; "
                               f"this launcher asks for {cfg.min_np} and {cfg.max_np}")
        if any(m.host == cfg.host and m.attached for m in view.members):
            raise LaunchFailed(f"job {cfg.job_id} already has workers from host {cfg.host}: give this launcher "
                               "another --host")
        self.min_np, self.max_np = view.min_np, view.max_np
        self.reporter.last = view   # report changes from here on, not the job's history
        self.reporter.world = set(view.ranks())
        self.out.info(f"joining job {cfg.job_id} at world {view.world_version} ({len(view.ranks())} worker(s), "
                      f"phase {view.phase})")

    # ------------------------------------------------------------------ workers
    def _spawn(self, slot: int) -> Worker:
        cfg = self.cfg
        n = self.spawns.get(slot, 0)
        self.spawns[slot] = n + 1
        worker_id = f"{cfg.host}-{slot}" + (f"-r{n}" if n else "")
        env = spawn_env(os.environ, cfg, slot=slot, incarnation=n, worker_id=worker_id, addresses=self._addresses,
                        local_slots=self.target, token_file=self._token_file,
                        metrics_env=self.metrics.worker_env(worker_id) if self.metrics is not None else {})
        try:
            w = self._start(slot, n, worker_id, env)
        except OSError as e:
            raise LaunchFailed(f"cannot start {cfg.command[0]!r}: {e.strerror}") from None
        if self.metrics is not None:
            self.metrics.attach(worker_id, w.pid)
        self.workers[slot] = w
        self.all_workers.append(w)
        self.reporter.note_start(worker_id, time.monotonic())
        return w

    def _start(self, slot: int, n: int, worker_id: str, env: Dict[str, str]) -> Worker:
        if self.forkserver is not None and self.fork_workers:
            try:
                return Worker(slot, n, worker_id, self.cfg.command, env, self.out, forkserver=self.forkserver)
            except ForkServerError as e:
                # Killed (the OOM killer, a stray signal), stalled, or out of processes: the job goes
                # on, its workers start as new processes (those it forked live on until they end).
                self.out.note(f"--preload: {e}; worker {worker_id} and those after it start as new processes")
                self.fork_workers = False
        return Worker(slot, n, worker_id, self.cfg.command, env, self.out)

    def _scale(self) -> None:
        """Runs slots 0..target-1 (those not finished or waiting to respawn); stops the others."""
        started = []
        for slot in range(self.target):
            w = self.workers.get(slot)
            if slot in self.succeeded or slot in self.respawn_at or (w is not None and (w.alive or not w.stopping)):
                continue
            started.append(self._spawn(slot))
        if started:
            self.out.info(f"started {len(started)} worker(s): "
                          + ", ".join(f"{w.worker_id} (pid {w.pid})" for w in started))
        for w in started:
            self._event("worker_started", worker_id=w.worker_id, slot=w.slot, pid=w.pid, restart=w.restart)
        for slot, w in self.workers.items():
            if slot >= self.target and w.alive and not w.stopping:
                self.out.note(f"draining {self._label(w)}: discovery gives this host {self.target} slot(s); "
                              "it leaves the job at its next commit")
                w.drain(time.monotonic() + self.cfg.preempt_grace + self.cfg.stop_timeout)
        for slot in [s for s in self.respawn_at if s >= self.target]:
            del self.respawn_at[slot]

    def _label(self, w: Worker) -> str:
        rank = self.reporter.rank_of(w.worker_id)
        return f"worker {w.worker_id}" + (f" (rank {rank})" if rank is not None else "")

    def _reap(self, now: float) -> None:
        for slot, w in list(self.workers.items()):
            if w.handled:
                continue
            if w.stop_deadline is not None and now >= w.stop_deadline and w.alive:
                self.out.note(f"{self._label(w)} did not leave within --preempt-grace + --stop-timeout; killing it")
                w.stop_deadline = None
                w.signal_group(signal.SIGKILL)
            code = w.poll()
            if code is None:
                continue
            w.handled = True
            self._on_exit(slot, w, code, now)

    def _on_exit(self, slot: int, w: Worker, code: int, now: float) -> None:
        cfg = self.cfg
        what = describe_exit(code)
        rank = self.reporter.rank_of(w.worker_id)
        self._note_exit(w, code)
        if code == 0 and (w.stopping or (self.reporter.was_member(w.worker_id) and not self._job_over())):
            # It exited 0 while the job runs: it left gracefully (SIGTERM, elastic.request_leave()).
            w.left = True
            self.reporter.note_left(w.worker_id)
            straggler = None if w.stopping else self.stragglers.left(w.worker_id, slot, self._status_now())
            self._event("preempted", worker_id=w.worker_id, slot=slot, why="drained by discovery" if w.stopping
                        else "a straggler" if straggler is not None else "left the job")
            if straggler is not None:   # --straggler-policy evict: the slot is retired
                self.out.note(f"{self._label(w)} {straggler}")
            else:
                self.out.note(f"{self._label(w)} left (" + (f"drained: discovery gives this host {self.target} "
                              "slot(s)" if w.stopping else "preempted") + "); not respawned")
        if w.stopping or w.left or code == 0:
            self.ends.append(WorkerEnd(w.worker_id, rank, code, stopped=w.stopping, left=w.left))
            if not w.stopping:
                self.succeeded.add(slot)
            return
        view = self._status_now()
        if view is not None and view.terminal:
            # After the job's end: _follow_job decides (a failure after success fails the launcher).
            # Only a traceback's line: after training, its last log line says nothing about this.
            error = "" if signal_of(code) is not None else w.last_error_line(fallback=False)
            self.ends.append(WorkerEnd(w.worker_id, rank, code, error=error))
            return
        self.ends.append(WorkerEnd(w.worker_id, rank, code, during_job=True))
        label = self._label(w)
        plan = plan_exit(code, self.failures.get(slot, 0), cfg.max_restarts, self.outvoted.get(slot, 0))
        if plan.fail:
            err = w.last_error_line()
            raise LaunchFailed(f"{label} {what}" + (f": {err}" if err else "") + "; " + self._giving_up())
        self.last_failure = f"{label} {what}"
        self.reporter.note_failure(f"{w.worker_id} {what}", now, frozenset({w.worker_id}))
        self.outvoted[slot] = self.outvoted.get(slot, 0) + (code == DIVERGED_EXIT)
        if plan.respawn:
            self.failures[slot] = self.failures.get(slot, 0) + 1
            self.respawn_at[slot] = now + plan.delay
        self.out.note(f"{label} {what}; {plan.note}")

    def _giving_up(self) -> str:
        """What ending this launcher on a worker's error means for the job: with the embedded
        server the job stops with it; with --rendezvous only this host's part does."""
        if self.cfg.embedded:
            return f"job {self.cfg.job_id} stopped"
        return (f"elastic-run on host {self.cfg.host} gave up and stopped its workers; job {self.cfg.job_id} "
                f"is not stopped by it (it goes on while its other workers keep it at min-np)")

    def _respawn_due(self, now: float) -> None:
        for slot, at in list(self.respawn_at.items()):
            if now >= at:
                del self.respawn_at[slot]
                if self.view is not None and self.view.terminal:
                    continue
                if host_cooling(self.view, self.cfg.host):   # its join would be refused: after the cooldown
                    self.respawn_at[slot] = now + STATUS_EVERY_S
                    continue
                replaces = self.workers[slot].worker_id if slot in self.workers else None
                w = self._spawn(slot)
                if self.metrics is not None:
                    self.metrics.note_restart(slot)
                self._event("worker_respawned", worker_id=w.worker_id, slot=slot, pid=w.pid, restart=w.restart,
                            replaces=replaces)
                self.out.info(f"respawned slot {slot} as {w.worker_id} (pid {w.pid})")

    # ------------------------------------------------------------------ the job
    def _job_over(self) -> bool:
        view = self._status_now()
        return view is not None and view.terminal

    def _status_now(self) -> Optional[JobStatusInfo]:
        try:
            # A few recent events: the server's word on who left cleanly and who was evicted
            # (a member gone from the world is no failure when it left).
            view = self.status.job(self.cfg.job_id, timeout_s=2.0, events=RECENT_EVENTS)
        except StatusError:
            return self.view
        return view if view is not None else self.view

    def _follow_job(self, now: float) -> Optional[int]:
        cfg = self.cfg
        if self.server is not None and not self.server.alive():
            raise LaunchFailed(f"the embedded rendezvous server exited with status {self.server.proc.returncode}")
        try:
            view = self.status.job(cfg.job_id, timeout_s=1.0, events=RECENT_EVENTS)
        except StatusError:
            return None  # workers ride through a server restart on their own; so does the launcher
        if view is None:
            return None
        before = self.reporter.last.world_version if self.reporter.last is not None else 0
        recoveries = len(self.reporter.recoveries)
        for msg in self.reporter.update(view, now):
            (self.out.note if msg.notable else self.out.info)(msg)
        self.view = view
        self._job_events(view, before, recoveries)
        for named in self.stragglers.update(view, {w.worker_id for w in self.workers.values()}):
            self.out.note(named.line)
            self._event("straggler_detected", **named.fields)
        if view.phase == "FAILED":
            self._wait_local_exit(FAILED_GRACE_S)
            more = f" (last failure on this host: {self.last_failure})" if self.last_failure else ""
            raise JobBelowMinNp(f"job {cfg.job_id} failed: {_strip_job(view.reason, cfg.job_id)}{more}")
        if view.phase == "SUCCEEDED":
            self._wait_local_exit(SUCCESS_GRACE_S)
            self._check_signal()
            self._reap(time.monotonic())
            running = [WorkerEnd(w.worker_id, self.reporter.rank_of(w.worker_id), None)
                       for w in self.workers.values() if not w.handled]
            failure = completion_failure(self.ends + running, cfg.job_id, SUCCESS_GRACE_S)
            if failure is None:   # said at once: the server may stay up a little for other hosts
                self.out.note(f"job {cfg.job_id} completed" + self._recovery_summary())
            if self.server is not None:
                self._wait_remote_detach(10.0)
            if failure is not None:
                raise LaunchFailed(failure)
            return 0
        return None

    def _job_events(self, view: JobStatusInfo, version_before: int, recoveries_before: int) -> None:
        """world_formed and recovery events for what the last Status answer showed."""
        if view.world_version > 0 and view.world_version != version_before:
            ranked = sorted((m.rank, m.worker_id) for m in view.members if m.rank is not None)
            self._event("world_formed", size=len(ranked), workers=[w for _, w in ranked[:MAX_EVENT_WORKERS]],
                        phase=view.phase)
        for took in self.reporter.recoveries[recoveries_before:]:
            self._event("recovery", seconds=round(took, 3), after=self.reporter.failure_what)

    def _local_end(self) -> Optional[int]:
        """The end decided by the local workers alone (all done, or all gone for good)."""
        # A worker that exited after this round's _reap has not been acted on yet (its failure
        # line, a respawn): the end is decided once every exit was.
        if any(not w.handled for w in self.workers.values()) or self.respawn_at or self.cfg.host_discovery_script:
            return None
        view = self._status_now()
        if view is not None and view.terminal:
            return None  # _follow_job reports the job's end
        if self.target and self.succeeded >= set(range(self.target)):
            if any(self.workers[s].left for s in range(self.target) if s in self.workers):
                self.out.note(f"every local worker left job {self.cfg.job_id}; it goes on without host "
                              f"{self.cfg.host}" if not self.cfg.embedded else
                              f"every worker left job {self.cfg.job_id}")
                return 0
            # Every worker exited 0 without the job being marked done (a script not under elastic.run).
            self.out.note(f"job {self.cfg.job_id} completed" + self._recovery_summary())
            return 0
        if self.cfg.embedded:
            return None  # the server decides: workers of other hosts may go on, or it fails the job
        raise LaunchFailed(f"every local worker is gone ({self.last_failure or 'none left'}); "
                           f"job {self.cfg.job_id} goes on without host {self.cfg.host}")

    def _wait_local_exit(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(w.alive for w in self.all_workers) and time.monotonic() < deadline:
            self._check_signal()
            time.sleep(POLL_S)

    def _wait_remote_detach(self, timeout_s: float) -> None:
        """Keeps the embedded server up while workers of other hosts still hear about the job's end, and
        REMOTE_END_GRACE_S after, for their launchers: finding it gone, one would take its worker's exit 0
        for a graceful leave."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.signum is None:   # the job is over: a signal only ends the wait
            view = self._status_now()
            if view is None or not any(m.attached for m in view.members):
                if view is None or all(m.host == self.cfg.host for m in view.members):
                    return
                deadline = min(deadline, time.monotonic() + REMOTE_END_GRACE_S)
            time.sleep(STATUS_EVERY_S)

    def _recovery_summary(self) -> str:
        r = self.reporter.recoveries
        if not r:
            return ""
        return f" ({len(r)} recovery(ies), {min(r):.2f}-{max(r):.2f} s each)"

    # ------------------------------------------------------------------ discovery
    def _names(self) -> set:
        return {self.cfg.host, socket.gethostname(), "localhost", "127.0.0.1"}

    def _apply_hosts(self, hosts: Dict[str, int]) -> None:
        slots = min(local_slots(hosts, self._names()), self.max_np, len(self.cfg.gpus) or self.max_np)
        if hosts != self._last_hosts:
            others = {h: s for h, s in hosts.items() if h not in self._names()}
            self.out.info(f"discovery: {slots} slot(s) on this host ({self.cfg.host})"
                          + ("; other hosts, not started by this launcher (run elastic-run --rendezvous there): "
                             + ", ".join(f"{h}:{s}" for h, s in sorted(others.items())) if others else ""))
            self._last_hosts = hosts
        if slots != self.target:
            self.target = slots
            # A slot that discovery takes away and gives back starts fresh.
            for slot in list(self.succeeded):
                if slot >= slots:
                    self.succeeded.discard(slot)
        self._scale()


def refusal_line(refused: StatusFailure, cfg: LaunchConfig) -> str:
    """Why a server that answered turned this launcher away, and the fix (it did answer: no
    "cannot reach")."""
    code = refused.code.name
    if refused.code is grpc.StatusCode.UNAUTHENTICATED:
        fix = ("give the token file the server was started with: --token-file F (workers get it as "
               "ELASTIC_TOKEN_FILE)" if cfg.token is None else
               "the token given (--token-file, ELASTIC_TOKEN or ELASTIC_TOKEN_FILE) is not one in the server's "
               "--token-file")
        return f"the rendezvous server at {refused.address} refused the token ({code}): {fix}"
    return f"the rendezvous server at {refused.address} refused this launcher's credentials ({code})"


def _strip_job(reason: str, job_id: str) -> str:
    prefix = f"job {job_id}: "
    return reason[len(prefix):] if reason.startswith(prefix) else reason


MAX_EVENT_WORKERS = 64   # a world_formed line names at most this many workers (size says how many)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse(argv)
    except UsageError as e:
        print(f"elastic-run: error: {e} (see elastic-run --help)", file=sys.stderr)
        return 2
    raise_open_files_limit()
    out, err = stdout_streams()
    return Launcher(cfg, Output(out, err, quiet=cfg.log_level not in ("DEBUG", "INFO"))).run()

