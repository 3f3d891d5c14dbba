from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobSpec(_message.Message):
    __slots__ = ("min_np", "max_np", "elastic_timeout_s")
    MIN_NP_FIELD_NUMBER: _ClassVar[int]
    MAX_NP_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    min_np: int
    max_np: int
    elastic_timeout_s: float
    def __init__(self, min_np: _Optional[int] = ..., max_np: _Optional[int] = ..., elastic_timeout_s: _Optional[float] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("job_id", "worker_id", "host", "ring_address", "commit_step", "spec", "session_id", "spec_if_new")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    RING_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_STEP_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_IF_NEW_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    worker_id: str
    host: str
    ring_address: str
    commit_step: int
    spec: JobSpec
    session_id: str
    spec_if_new: JobSpec
    def __init__(self, job_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., host: _Optional[str] = ..., ring_address: _Optional[str] = ..., commit_step: _Optional[int] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., session_id: _Optional[str] = ..., spec_if_new: _Optional[_Union[JobSpec, _Mapping]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("session_id", "world_version", "spec", "ring_secret")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RING_SECRET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    world_version: int
    spec: JobSpec
    ring_secret: bytes
    def __init__(self, session_id: _Optional[str] = ..., world_version: _Optional[int] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., ring_secret: _Optional[bytes] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("session_id", "commit_step")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_STEP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit_step: int
    def __init__(self, session_id: _Optional[str] = ..., commit_step: _Optional[int] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("worker_id", "host", "ring_address", "rank", "local_rank", "local_size", "cross_rank", "cross_size", "commit_step")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    RING_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CROSS_RANK_FIELD_NUMBER: _ClassVar[int]
    CROSS_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_STEP_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    host: str
    ring_address: str
    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    commit_step: int
    def __init__(self, worker_id: _Optional[str] = ..., host: _Optional[str] = ..., ring_address: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., local_size: _Optional[int] = ..., cross_rank: _Optional[int] = ..., cross_size: _Optional[int] = ..., commit_step: _Optional[int] = ...) -> None: ...

class World(_message.Message):
    __slots__ = ("world_version", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "peers", "digest", "num_hosts", "host_index", "largest_host", "prev_leader", "next_leader", "aborted")
    WORLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CROSS_RANK_FIELD_NUMBER: _ClassVar[int]
    CROSS_SIZE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_HOSTS_FIELD_NUMBER: _ClassVar[int]
    HOST_INDEX_FIELD_NUMBER: _ClassVar[int]
    LARGEST_HOST_FIELD_NUMBER: _ClassVar[int]
    PREV_LEADER_FIELD_NUMBER: _ClassVar[int]
    NEXT_LEADER_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    world_version: int
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    peers: _containers.RepeatedCompositeFieldContainer[Member]
    digest: bytes
    num_hosts: int
    host_index: int
    largest_host: int
    prev_leader: int
    next_leader: int
    aborted: AbortVersion
    def __init__(self, world_version: _Optional[int] = ..., rank: _Optional[int] = ..., size: _Optional[int] = ..., local_rank: _Optional[int] = ..., local_size: _Optional[int] = ..., cross_rank: _Optional[int] = ..., cross_size: _Optional[int] = ..., peers: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., digest: _Optional[bytes] = ..., num_hosts: _Optional[int] = ..., host_index: _Optional[int] = ..., largest_host: _Optional[int] = ..., prev_leader: _Optional[int] = ..., next_leader: _Optional[int] = ..., aborted: _Optional[_Union[AbortVersion, _Mapping]] = ...) -> None: ...

class MembershipPending(_message.Message):
    __slots__ = ("world_version", "reason")
    WORLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    world_version: int
    reason: str
    def __init__(self, world_version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortVersion(_message.Message):
    __slots__ = ("world_version", "reason", "acknowledge")
    WORLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGE_FIELD_NUMBER: _ClassVar[int]
    world_version: int
    reason: str
    acknowledge: bool
    def __init__(self, world_version: _Optional[int] = ..., reason: _Optional[str] = ..., acknowledge: _Optional[bool] = ...) -> None: ...

class Standby(_message.Message):
    __slots__ = ("world_version", "reason")
    WORLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    world_version: int
    reason: str
    def __init__(self, world_version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Probe(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    def __init__(self, nonce: _Optional[int] = ...) -> None: ...

class JobOutcome(_message.Message):
    __slots__ = ("succeeded", "reason")
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    succeeded: bool
    reason: str
    def __init__(self, succeeded: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("world", "pending", "abort", "standby", "probe", "finished")
    WORLD_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    world: World
    pending: MembershipPending
    abort: AbortVersion
    standby: Standby
    probe: Probe
    finished: JobOutcome
    def __init__(self, world: _Optional[_Union[World, _Mapping]] = ..., pending: _Optional[_Union[MembershipPending, _Mapping]] = ..., abort: _Optional[_Union[AbortVersion, _Mapping]] = ..., standby: _Optional[_Union[Standby, _Mapping]] = ..., probe: _Optional[_Union[Probe, _Mapping]] = ..., finished: _Optional[_Union[JobOutcome, _Mapping]] = ...) -> None: ...

class StragglerReport(_message.Message):
    __slots__ = ("world_version", "score", "slow_windows", "named")
    WORLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SLOW_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    NAMED_FIELD_NUMBER: _ClassVar[int]
    world_version: int
    score: float
    slow_windows: int
    named: bool
    def __init__(self, world_version: _Optional[int] = ..., score: _Optional[float] = ..., slow_windows: _Optional[int] = ..., named: _Optional[bool] = ...) -> None: ...

class ReportProgressRequest(_message.Message):
    __slots__ = ("session_id", "commit_step", "straggler", "stepped_world", "step")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_STEP_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    STEPPED_WORLD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit_step: int
    straggler: StragglerReport
    stepped_world: int
    step: int
    def __init__(self, session_id: _Optional[str] = ..., commit_step: _Optional[int] = ..., straggler: _Optional[_Union[StragglerReport, _Mapping]] = ..., stepped_world: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class ReportProgressResponse(_message.Message):
    __slots__ = ("world_version", "spares")
    WORLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    world_version: int
    spares: int
    def __init__(self, world_version: _Optional[int] = ..., spares: _Optional[int] = ...) -> None: ...

class AnswerProbeRequest(_message.Message):
    __slots__ = ("session_id", "nonce")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    nonce: int
    def __init__(self, session_id: _Optional[str] = ..., nonce: _Optional[int] = ...) -> None: ...

class AnswerProbeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcknowledgeAbortRequest(_message.Message):
    __slots__ = ("session_id", "world_version")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    world_version: int
    def __init__(self, session_id: _Optional[str] = ..., world_version: _Optional[int] = ...) -> None: ...

class AcknowledgeAbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("session_id", "straggler")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    straggler: bool
    def __init__(self, session_id: _Optional[str] = ..., straggler: _Optional[bool] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportFailureRequest(_message.Message):
    __slots__ = ("session_id", "world_version", "suspect_worker_id", "reason", "unusable_address", "timed_out", "blame", "suspect_rank")
    class Blame(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NONE: _ClassVar[ReportFailureRequest.Blame]
        UNUSABLE: _ClassVar[ReportFailureRequest.Blame]
        IMPOSSIBLE_ROW: _ClassVar[ReportFailureRequest.Blame]
        FALSE_PENDING: _ClassVar[ReportFailureRequest.Blame]
        FALSE_LEAVE: _ClassVar[ReportFailureRequest.Blame]
        DIVERGED: _ClassVar[ReportFailureRequest.Blame]
        UNRECEIVABLE: _ClassVar[ReportFailureRequest.Blame]
    NONE: ReportFailureRequest.Blame
    UNUSABLE: ReportFailureRequest.Blame
    IMPOSSIBLE_ROW: ReportFailureRequest.Blame
    FALSE_PENDING: ReportFailureRequest.Blame
    FALSE_LEAVE: ReportFailureRequest.Blame
    DIVERGED: ReportFailureRequest.Blame
    UNRECEIVABLE: ReportFailureRequest.Blame
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UNUSABLE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    BLAME_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_RANK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    world_version: int
    suspect_worker_id: str
    reason: str
    unusable_address: bool
    timed_out: bool
    blame: ReportFailureRequest.Blame
    suspect_rank: int
    def __init__(self, session_id: _Optional[str] = ..., world_version: _Optional[int] = ..., suspect_worker_id: _Optional[str] = ..., reason: _Optional[str] = ..., unusable_address: _Optional[bool] = ..., timed_out: _Optional[bool] = ..., blame: _Optional[_Union[ReportFailureRequest.Blame, str]] = ..., suspect_rank: _Optional[int] = ...) -> None: ...

class ReportFailureResponse(_message.Message):
    __slots__ = ("evicted", "detail")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    evicted: bool
    detail: str
    def __init__(self, evicted: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class ReportSuccessRequest(_message.Message):
    __slots__ = ("session_id", "world_version", "commit_step")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMMIT_STEP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    world_version: int
    commit_step: int
    def __init__(self, session_id: _Optional[str] = ..., world_version: _Optional[int] = ..., commit_step: _Optional[int] = ...) -> None: ...

class ReportSuccessResponse(_message.Message):
    __slots__ = ("finished",)
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    finished: bool
    def __init__(self, finished: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job_id", "events", "members_from", "max_members")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FROM_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    events: int
    members_from: int
    max_members: int
    def __init__(self, job_id: _Optional[str] = ..., events: _Optional[int] = ..., members_from: _Optional[int] = ..., max_members: _Optional[int] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("time", "event", "world_version", "worker_id", "detail", "numbers")
    class NumbersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TIME_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    WORLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    NUMBERS_FIELD_NUMBER: _ClassVar[int]
    time: float
    event: str
    world_version: int
    worker_id: str
    detail: str
    numbers: _containers.ScalarMap[str, float]
    def __init__(self, time: _Optional[float] = ..., event: _Optional[str] = ..., world_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., detail: _Optional[str] = ..., numbers: _Optional[_Mapping[str, float]] = ...) -> None: ...

class MemberStatus(_message.Message):
    __slots__ = ("member", "in_world", "attached", "age_s", "straggler", "stepped_world", "step")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    IN_WORLD_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    STEPPED_WORLD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    member: Member
    in_world: bool
    attached: bool
    age_s: float
    straggler: StragglerReport
    stepped_world: int
    step: int
    def __init__(self, member: _Optional[_Union[Member, _Mapping]] = ..., in_world: _Optional[bool] = ..., attached: _Optional[bool] = ..., age_s: _Optional[float] = ..., straggler: _Optional[_Union[StragglerReport, _Mapping]] = ..., stepped_world: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "spec", "world_version", "phase", "reason", "members", "blacklisted_hosts", "events", "members_from", "members_total")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    WORLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    BLACKLISTED_HOSTS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FROM_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: JobSpec
    world_version: int
    phase: str
    reason: str
    members: _containers.RepeatedCompositeFieldContainer[MemberStatus]
    blacklisted_hosts: _containers.RepeatedScalarFieldContainer[str]
    events: _containers.RepeatedCompositeFieldContainer[JobEvent]
    members_from: int
    members_total: int
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., world_version: _Optional[int] = ..., phase: _Optional[str] = ..., reason: _Optional[str] = ..., members: _Optional[_Iterable[_Union[MemberStatus, _Mapping]]] = ..., blacklisted_hosts: _Optional[_Iterable[str]] = ..., events: _Optional[_Iterable[_Union[JobEvent, _Mapping]]] = ..., members_from: _Optional[int] = ..., members_total: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("leader_id", "jobs")
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    leader_id: str
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    def __init__(self, leader_id: _Optional[str] = ..., jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...
