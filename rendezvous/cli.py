"""`elastic-rendezvous`: run the rendezvous daemon (`serve`) or print a server's jobs (`status`)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Optional, Sequence

import grpc

from rendezvous import __version__
from rendezvous.client import status_view
from rendezvous.client.status_client import StatusClient, StatusError
from rendezvous.client.status_view import format_status
from rendezvous.common import files, local_jobs
from rendezvous.common.channel import channel_credentials, parse_addresses, read_token_file, read_token_list
from rendezvous.common.client_flags import TOKEN_FILE, add_client_flags
from rendezvous.common.event_log import EventLog
from rendezvous.common.ports import check_can_listen
from rendezvous.server.history import RECENT_PER_JOB
from rendezvous.server.server_config import ServerConfig, default
from rendezvous.server.store import EtcdAccessError, EtcdStore, StoreError

DESCRIPTION = """\
The elastic-ring rendezvous service: decides which workers are in a training job (world versions,
ranks, evictions) and keeps all state in etcd so a restart or failover changes nothing.

  elastic-rendezvous serve --port 29400 --etcd 10.0.0.9:2379 --token-file /etc/elastic/token
  elastic-rendezvous serve --insecure                     # in-memory store, no auth (one machine)
  elastic-rendezvous serve --token-file /etc/elastic/token --tls-cert srv.pem --tls-key srv.key \\
      --tls-client-ca ca.pem --etcd 10.0.0.9:2379 --etcd-ca etcd-ca.pem --etcd-user rdzv \\
      --etcd-password-file /etc/elastic/etcd-password    # TLS and auth end to end
  elastic-rendezvous serve --insecure --metrics-port 9400 --events /var/log/elastic/rdzv.jsonl
  elastic-rendezvous status      # the job an elastic-run of yours serves on this machine
  elastic-rendezvous status --server 10.0.0.1:29400 --token-file /etc/elastic/token
  elastic-rendezvous status --server 10.0.0.1:29400 --token-file /etc/elastic/token --watch
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastic-rendezvous", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                   help="print elastic-rendezvous's version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="{serve,status}")
    # No abbreviated flags: `--etcd-password X` must not pass for `--etcd-password-file X`.
    s = sub.add_parser("serve", help="run the rendezvous daemon", allow_abbrev=False,
                       description="Run the rendezvous daemon. SIGTERM/SIGINT stop it gracefully "
                                   "(streams end without evicting anyone; leadership is handed over).")
    # Every default is ServerConfig's (rendezvous/server/server_config.py): it is defined there only.
    s.add_argument("--host", default=default("host"), help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=int, default=default("port"),
                   help="port to listen on; 0 picks a free one (default: %(default)s)")
    s.add_argument("--etcd", default="", metavar="HOST:PORT[,HOST:PORT...]",
                   help="etcd v3 endpoints; without it the state lives in memory (single server)")
    s.add_argument("--etcd-prefix", default=default("etcd_prefix"),
                   help="key prefix in etcd (default: %(default)s)")
    auth = s.add_mutually_exclusive_group(required=True)
    auth.add_argument("--token-file", metavar="F", help="file of accepted tokens, one a line; every "
                                                        "RPC must send 'authorization: Bearer <token>'"
                                                        " and a job belongs to the token that "
                                                        "created it")
    auth.add_argument("--insecure", action="store_true", help="accept requests without a token: anyone "
                                                              "who can reach the server can join")
    s.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    s.add_argument("--tls-key", metavar="PEM", help="private key for --tls-cert")
    s.add_argument("--tls-client-ca", metavar="PEM",
                   help="require client certificates signed by this CA (workers, launchers and "
                        "status then need --tls-cert/--tls-key or ELASTIC_TLS_CERT/ELASTIC_TLS_KEY)")
    s.add_argument("--etcd-ca", metavar="PEM", help="connect to etcd with TLS, trusting this CA")
    s.add_argument("--etcd-cert", metavar="PEM",
                   help="client certificate for etcd (started with --client-cert-auth)")
    s.add_argument("--etcd-key", metavar="PEM", help="private key for --etcd-cert")
    s.add_argument("--etcd-user", metavar="USER",
                   help="authenticate to etcd as USER (needs --etcd-ca); the password comes from "
                        "--etcd-password-file or ELASTIC_ETCD_PASSWORD, never the command line")
    s.add_argument("--etcd-password-file", metavar="F", help="file holding --etcd-user's password")
    s.add_argument("--heartbeat-timeout", type=float, default=default("heartbeat_timeout_s"), metavar="S",
                   help="evict a worker that stops answering keepalive pings within S seconds "
                        "(default: %(default)s)")
    s.add_argument("--leader-ttl", type=int, default=default("leader_ttl_s"), metavar="S",
                   help="TTL of the leader's etcd lease: a failed leader is replaced after about S "
                        "seconds; workers get heartbeat timeout + S + 2 s to reattach "
                        "(default: %(default)s)")
    s.add_argument("--settle", type=float, default=default("settle_s"), metavar="S",
                   help="batch membership changes arriving within S seconds into one world; after "
                        "a failure the world forms sooner, as soon as every live member acknowledged "
                        "the abort (default: %(default)s)")
    s.add_argument("--settle-max", type=float, default=default("settle_max_s"), metavar="S",
                   help="under a steady trickle of changes, form the world at most S seconds after "
                        "the first one (default: 10 x --settle, at least 2)")
    s.add_argument("--elastic-timeout", type=float, default=default("default_elastic_timeout_s"),
                   metavar="S",
                   help="default time a job may stay below min-np before failing "
                        "(default: %(default)s)")
    s.add_argument("--blacklist-after", type=int, default=default("blacklist_after"), metavar="N",
                   help="blacklist a host after N failures; 0 never does (default: %(default)s)")
    s.add_argument("--blacklist-cooldown-range", type=float, nargs=2,
                   default=(default("cooldown_min_s"), default("cooldown_max_s")),
                   metavar=("MIN", "MAX"), help="cooldown doubles from MIN up to MAX seconds "
                                                "(default: %s %s)" % (default("cooldown_min_s"),
                                                                      default("cooldown_max_s")))
    s.add_argument("--advertise", default=default("advertise_address"), metavar="HOST:PORT",
                   help="address clients use to reach this replica (leader hints)")
    s.add_argument("--metrics-port", type=int, default=default("metrics_port"), metavar="P",
                   help="serve Prometheus metrics on http://METRICS_HOST:P/metrics (default: not "
                        "served; 0 picks a free port)")
    s.add_argument("--metrics-host", default=default("metrics_host"), metavar="ADDR",
                   help="address for --metrics-port (default: %(default)s, this machine only: the "
                        "metrics name every tenant's jobs and need no token; bind a monitoring "
                        "network's address to scrape from elsewhere)")
    s.add_argument("--events", default=default("events_path"), metavar="FILE",
                   help="append one JSON line per event (server started/stopped, leader elected, "
                        "job created, world formed, worker joined/left/evicted, job finished) to "
                        "FILE")
    s.add_argument("--port-file", metavar="F", help="write the bound port to F once serving")
    s.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    t = sub.add_parser("status", help="print a server's jobs, worlds and members as a table")
    t.add_argument("--server", metavar="HOST:PORT[,HOST:PORT...]",
                   help="the rendezvous servers, as elastic-run --rendezvous takes them: each is asked in turn "
                        "until one answers (any replica answers Status). Default: the job an elastic-run of "
                        "this user serves on this machine, with its token")
    t.add_argument("--job", default="", help="only this job")
    add_client_flags(t)   # --token-file, --tls-ca, --tls-cert, --tls-key, as elastic-run's
    t.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="give up on a server after S seconds (default: %(default)s)")
    t.add_argument("--watch", action="store_true",
                   help="redraw the table every --interval seconds until Ctrl-C, with the last "
                        "events; retries while no server answers. When stdout is not a terminal, "
                        "print one snapshot and exit")
    t.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help="seconds between redraws of --watch (default: %(default)s)")
    t.add_argument("--events", type=int, default=None, metavar="N",
                   help="also list the last N events of the jobs, as the answering replica saw "
                        "them (default: 10 with --watch, else 0; the server keeps 50 a job)")
    return p


def _read_secret(path: str, what: str) -> str:
    try:
        return read_token_file(path, what)
    except ValueError as e:
        raise SystemExit(f"elastic-rendezvous: {e}")


def _etcd_password(a: argparse.Namespace) -> Optional[str]:
    """--etcd-password-file, else ELASTIC_ETCD_PASSWORD (read only for --etcd-user: the variable
    may be set for other tools)."""
    if a.etcd_password_file:
        return _read_secret(a.etcd_password_file, "--etcd-password-file")
    return (os.environ.get("ELASTIC_ETCD_PASSWORD") or None) if a.etcd_user else None


def _read_tokens(path: str) -> tuple[str, ...]:
    try:
        return read_token_list(path, "token file")
    except ValueError as e:
        raise SystemExit(f"elastic-rendezvous: {e}")


def config_from_args(a: argparse.Namespace) -> ServerConfig:
    try:
        endpoints = parse_addresses(a.etcd, "--etcd") if a.etcd.strip() else ()
    except ValueError as e:
        raise SystemExit(f"elastic-rendezvous: {e}")
    if not 0 <= a.port < 65536:
        raise SystemExit(f"elastic-rendezvous: --port {a.port} is outside 0..65535")
    cfg = ServerConfig(host=a.host, port=a.port, etcd_endpoints=endpoints, etcd_prefix=a.etcd_prefix,
                       tokens=_read_tokens(a.token_file) if a.token_file else (),
                       insecure=a.insecure, tls_cert=a.tls_cert, tls_key=a.tls_key,
                       tls_client_ca=a.tls_client_ca, etcd_ca=a.etcd_ca, etcd_cert=a.etcd_cert,
                       etcd_key=a.etcd_key, etcd_user=a.etcd_user,
                       etcd_password=_etcd_password(a),
                       heartbeat_timeout_s=a.heartbeat_timeout, settle_s=a.settle,
                       leader_ttl_s=a.leader_ttl, settle_max_s=a.settle_max,
                       default_elastic_timeout_s=a.elastic_timeout,
                       blacklist_after=a.blacklist_after,
                       cooldown_min_s=a.blacklist_cooldown_range[0],
                       cooldown_max_s=a.blacklist_cooldown_range[1], advertise_address=a.advertise,
                       metrics_port=a.metrics_port, metrics_host=a.metrics_host,
                       events_path=a.events)
    try:
        cfg.validate()
        # Read the PEM files now: a bad one is a usage error, not a failure after start.
        cfg.server_credentials()
        channel_credentials(cfg.etcd_ca, cfg.etcd_cert, cfg.etcd_key,
                            names=("--etcd-ca", "--etcd-cert", "--etcd-key"))
    except ValueError as e:
        raise SystemExit(f"elastic-rendezvous: {e}")
    return cfg


async def _serve(cfg: ServerConfig, port_file: Optional[str], events: EventLog) -> None:
    from rendezvous.server.service import RendezvousServer

    log = logging.getLogger("rendezvous")
    warning = cfg.exposure_warning()
    if warning:
        log.warning("%s", warning)
    server = RendezvousServer(cfg, events=events)
    if isinstance(server.store, EtcdStore):
        try:
            await server.store.verify(f"{cfg.etcd_prefix}/leader")
        except EtcdAccessError:
            await server.store.close()
            raise
        except StoreError as e:   # etcd may come up later: the server waits for it
            log.warning("etcd not reachable yet (will keep trying): %s", e)
    port = await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if server.metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", cfg.metrics_host, server.metrics_port)
    log.info("elastic-rendezvous %s serving on %s:%d (%s store, %s, %s)", __version__, cfg.host, port,
             "etcd " + ",".join(cfg.etcd_endpoints) if cfg.etcd_endpoints else "in-memory",
             "token auth" if cfg.accepted_tokens() else "insecure",
             ("TLS, client certificates required" if cfg.tls_client_ca else "TLS")
             if cfg.tls_cert else "plaintext")
    if port_file:  # whoever polls for it never reads half a number, and a planted link is replaced, not followed
        files.replace(port_file, str(port).encode(), mode=0o644)
    await stop.wait()
    log.info("stopping (signal)")
    await server.stop()


def _local_job(a: argparse.Namespace) -> local_jobs.LocalJob:
    """The job an elastic-run of this user serves on this machine, when --server is not given."""
    jobs, skipped = local_jobs.found()
    for why in skipped:
        print(f"elastic-rendezvous status: passed over {why}", file=sys.stderr)
    if a.job:
        jobs = [j for j in jobs if j.job_id == a.job]
    if len(jobs) == 1:
        return jobs[0]
    if not jobs:
        raise SystemExit("elastic-rendezvous: no elastic-run job of this user found on this machine"
                         f"{f' named {a.job!r}' if a.job else ''} (looked in {local_jobs.directory()}); point "
                         "at a server with --server HOST:PORT, and --token-file F if it wants a token")
    listed = ", ".join(f"{j.job_id} on {j.server}" for j in jobs)
    raise SystemExit(f"elastic-rendezvous: {len(jobs)} elastic-run jobs of this user on this machine ({listed}): "
                     "choose one with --job ID (or --server HOST:PORT)")


def _status(a: argparse.Namespace) -> int:
    local = _local_job(a) if a.server is None else None
    token_file = a.token_file or os.environ.get(TOKEN_FILE.variable) or (local.token_file if local else None)
    token = _read_secret(token_file, 'token file') if token_file else None
    try:
        servers = parse_addresses(local.server if local else a.server, "--server")
        if not 0.1 <= a.interval <= 3600:
            raise ValueError(f"--interval {a.interval} is outside 0.1..3600 s")
        if a.events is not None and not 0 <= a.events <= RECENT_PER_JOB:
            raise ValueError(f"--events {a.events} is outside 0..{RECENT_PER_JOB}")
        if not 0 < a.timeout <= 600:
            raise ValueError(f"--timeout {a.timeout} is outside 0..600 s")
        creds = channel_credentials(a.tls_ca, a.tls_cert, a.tls_key)
    except ValueError as e:
        raise SystemExit(f"elastic-rendezvous: {e}")
    events = a.events if a.events is not None else (10 if a.watch else 0)
    with StatusClient(list(servers), token, creds) as client:
        if a.watch:
            return status_view.watch(lambda: client.status(a.job, timeout_s=a.timeout, events=events),
                                     server=",".join(servers), interval_s=a.interval, events=events)
        try:
            status = client.status(a.job, timeout_s=a.timeout, events=events)
        except StatusError as e:
            for f in e.failures:
                hint = ""
                if f.code == grpc.StatusCode.UNAUTHENTICATED:
                    hint = (f"; pass the job's token with --token-file F (or {TOKEN_FILE.variable}): elastic-run "
                            "prints where its embedded server's token is")
                print(f"elastic-rendezvous status: {f.address}: {f.code.name}: "
                      f"{status_view.safe(f.details, 400)}{hint}", file=sys.stderr)
            return 1
    print(format_status(status, events))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parser().parse_args(argv)
    if a.command == "status":
        return _status(a)
    cfg = config_from_args(a)
    try:
        check_can_listen(cfg.host, cfg.port, "--port")
        if cfg.metrics_port:
            check_can_listen(cfg.metrics_host, cfg.metrics_port, "--metrics-port")
        events = EventLog(cfg.events_path)   # opened now: a bad path is a flag error
    except ValueError as e:   # a flag error: exit 2, as argparse's, and no traceback from gRPC
        print(f"elastic-rendezvous: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=a.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_serve(cfg, a.port_file, events))
    except (OSError, EtcdAccessError) as e:
        print(f"elastic-rendezvous: {e}", file=sys.stderr)
        return 1
    finally:
        events.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
