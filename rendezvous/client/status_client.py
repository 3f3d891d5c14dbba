"""Status: what the service says about jobs, for whoever only watches them: the launcher
(`elastic-run` follows its job's worlds, ranks and end) and `elastic-rendezvous status`.

Answers are plain dataclasses; nothing outside this package sees the generated messages. Any
replica answers (a follower reads the store), so the configured servers are tried in turn. A
server lists a job's members in pages (4,096 a page): the rest of a job is read page after page,
from the same server, and read again from the start if its world changed in between.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Optional, Sequence

import grpc

from rendezvous.common.channel import RendezvousRPCError, open_channel
from rendezvous.wire.membership import StragglerReport
from rendezvous.wire.messages import pb, pb_grpc, straggler_from_pb

# Codes a server answers a caller it refuses with: retrying with the same credentials is pointless.
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
READS_PER_JOB = 5   # a job whose world changes under every read of its pages is given up on


class _Changing(Exception):
    """A job's world changed under each of READS_PER_JOB reads of its member pages."""


@dataclasses.dataclass(frozen=True)
class MemberStatusInfo:
    """One registered worker of a job, as Status shows it."""

    worker_id: str
    host: str
    rank: Optional[int]              # None: on standby (not in the world)
    attached: bool                   # has an open Watch stream on the leader
    commit_step: int
    ring_address: str = ""
    local_rank: int = 0              # this and the three below: meaningful in the world only
    local_size: int = 0
    cross_rank: int = 0
    cross_size: int = 0
    age_s: float = 0.0               # seconds since it joined
    straggler: Optional[StragglerReport] = None   # its latest report in the current world (None: none yet)
    stepped_world: int = 0           # the newest world it completed a training step in (0: none known)
    step: int = -1                   # the training step its last commit holds (-1: unknown)

    @property
    def in_world(self) -> bool:
        return self.rank is not None


@dataclasses.dataclass(frozen=True)
class JobEventInfo:
    """Something that happened to a job, as the answering replica saw it (its text is the
    server's: escape it before showing it on a terminal)."""

    time: float                      # Unix seconds
    event: str                       # world_formed, worker_joined, worker_evicted, …
    world_version: int
    worker_id: str = ""
    detail: str = ""
    numbers: Mapping[str, float] = dataclasses.field(default_factory=dict)   # its numeric fields (rank, …)


@dataclasses.dataclass(frozen=True)
class JobStatusInfo:
    """One job in a Status answer."""

    job_id: str
    phase: str                       # FORMING, RUNNING, WAITING (below min_np), SUCCEEDED, FAILED
    reason: str
    world_version: int
    min_np: int
    max_np: int
    elastic_timeout_s: float
    members: tuple[MemberStatusInfo, ...]
    blacklisted_hosts: tuple[str, ...] = ()
    events: tuple[JobEventInfo, ...] = ()    # oldest first, only when asked for

    @property
    def terminal(self) -> bool:
        return self.phase in ("SUCCEEDED", "FAILED")

    def ranks(self) -> dict[str, int]:
        """worker id -> rank, for the members of the current world."""
        return {m.worker_id: m.rank for m in self.members if m.rank is not None}


@dataclasses.dataclass(frozen=True)
class StatusInfo:
    """A whole Status answer."""

    leader_id: str                   # the replica that answered; empty: a follower, from the store
    jobs: tuple[JobStatusInfo, ...]


@dataclasses.dataclass(frozen=True)
class StatusFailure:
    """Why one server gave no Status answer."""

    address: str
    code: grpc.StatusCode
    details: str


class StatusError(RendezvousRPCError):
    """A Status call got no answer: no configured server answered (`failures` says why for each,
    in order), or one said NOT_FOUND (a job it does not know; the others are not asked). `code`
    is the last failure's."""

    def __init__(self, failures: Sequence[StatusFailure]):
        self.failures = tuple(failures)
        several = len(self.failures) > 1
        super().__init__("; ".join(
            (f"{f.address}: " if several else "") + f.code.name
            + (f" ({f.details.splitlines()[0]})" if f.details.strip() else "")
            for f in self.failures), self.failures[-1].code if self.failures else None)

    def refused(self) -> Optional[StatusFailure]:
        """The first server that answered by refusing the caller's credentials (the token, or a
        client certificate TLS let through): no retry will change that."""
        return next((f for f in self.failures if f.code in _REFUSED), None)


def _member_status(m: pb.MemberStatus) -> MemberStatusInfo:
    mm = m.member
    return MemberStatusInfo(mm.worker_id, mm.host, mm.rank if m.in_world else None, m.attached,
                            mm.commit_step, mm.ring_address, mm.local_rank, mm.local_size,
                            mm.cross_rank, mm.cross_size, m.age_s,
                            straggler_from_pb(m.straggler) if m.HasField("straggler") else None,
                            m.stepped_world, m.step)


def _job_status(j: pb.JobStatus, members: Sequence[pb.MemberStatus]) -> JobStatusInfo:
    return JobStatusInfo(j.job_id, j.phase, j.reason, j.world_version, j.spec.min_np,
                         j.spec.max_np, j.spec.elastic_timeout_s,
                         tuple(_member_status(m) for m in members), tuple(j.blacklisted_hosts),
                         tuple(JobEventInfo(e.time, e.event, e.world_version, e.worker_id, e.detail,
                                            dict(e.numbers)) for e in j.events))


class StatusClient:
    """Status RPCs against the configured servers, trying each in turn (any replica answers: a
    follower reads the store). TLS with `credentials` (from `channel_credentials`); the token, if
    any, goes as `authorization: Bearer` metadata, as for every other call.

        with StatusClient(["10.0.0.1:29400"], token=token, credentials=creds) as status:
            job = status.job("exp7")                 # JobStatusInfo, or None if unknown
            everything = status.status()             # StatusInfo: every job
    """

    def __init__(self, addresses: Sequence[str], token: Optional[str] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None, page: int = 0):
        if not addresses:
            raise ValueError("StatusClient needs at least one HOST:PORT server address")
        self.addresses = list(addresses)
        self.page = page   # members asked for a page at most (0: the server's page, 4,096)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channels = {a: open_channel(a, credentials) for a in self.addresses}
        self._stubs = {a: pb_grpc.RendezvousStub(ch) for a, ch in self._channels.items()}

    def status(self, job_id: str = "", timeout_s: float = 2.0, events: int = 0) -> StatusInfo:
        """The first answer from the servers in turn, about `job_id` (empty: every job), with up
        to `events` recent events per job. Raises StatusError when none answers (each gets up to
        `timeout_s`), or with code NOT_FOUND for a job the server does not know."""
        failures = []
        for address in self.addresses:
            try:
                return self._status_from(address, job_id, timeout_s, events)
            except grpc.RpcError as e:
                failures.append(StatusFailure(address, e.code(), e.details() or ""))
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    break   # an answer: every replica reads the same store
            except _Changing as e:
                failures.append(StatusFailure(address, grpc.StatusCode.ABORTED, str(e)))
        raise StatusError(failures)

    def _status_from(self, address: str, job_id: str, timeout_s: float, events: int) -> StatusInfo:
        """One server's answer, each job's members read to the end (raises grpc.RpcError)."""
        def call(**request) -> pb.StatusResponse:
            return self._stubs[address].Status(pb.StatusRequest(max_members=self.page, **request),
                                               timeout=timeout_s, metadata=self._metadata)
        resp = call(job_id=job_id, events=events)
        jobs = []
        for j in resp.jobs:
            for _ in range(READS_PER_JOB):
                try:
                    members = self._rest_of(call, j)
                    if members is not None:
                        jobs.append(_job_status(j, members))
                        break
                    # Its world changed between pages: read it again from the start.
                    (j,) = call(job_id=j.job_id, events=events).jobs
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                    break   # removed meanwhile
            else:
                raise _Changing(f"job {j.job_id}: its world changed under each of "
                                f"{READS_PER_JOB} reads of its {j.members_total} members; try again")
        return StatusInfo(resp.leader_id, tuple(jobs))

    @staticmethod
    def _rest_of(call, j: pb.JobStatus) -> Optional[list]:
        """Every member of job `j`, the pages after its first read from the same world; None when
        the world (or the number of members) changed in between. A server that does not page
        (members_total 0) listed them all."""
        members = list(j.members)
        while len(members) < j.members_total:
            (page,) = call(job_id=j.job_id, members_from=len(members)).jobs
            if (page.world_version != j.world_version or page.members_total != j.members_total
                    or page.members_from != len(members) or not page.members):
                return None
            members.extend(page.members)
        return members

    def job(self, job_id: str, timeout_s: float = 2.0, events: int = 0) -> Optional[JobStatusInfo]:
        """The job's status (with up to ``events`` recent events); None if the servers do not
        know it (yet). Raises StatusError."""
        try:
            answer = self.status(job_id, timeout_s, events=events)
        except StatusError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        for j in answer.jobs:
            if j.job_id == job_id:
                return j
        return None

    def wait_reachable(self, job_id: str, timeout_s: float,
                       cancelled: Callable[[], bool] = lambda: False) -> Optional[JobStatusInfo]:
        """Like job(), retrying until a server answers, the deadline passes or `cancelled()`. A
        server that refused the caller (UNAUTHENTICATED, PERMISSION_DENIED) answered: raised at once."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.job(job_id, timeout_s=max(0.5, min(2.0, deadline - time.monotonic())))
            except StatusError as e:
                if time.monotonic() >= deadline or cancelled() or e.refused() is not None:
                    raise
            time.sleep(0.2)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()

    def __enter__(self) -> "StatusClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
