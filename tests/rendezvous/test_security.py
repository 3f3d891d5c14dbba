"""Token auth and input validation: bad, malformed (fuzzed) and unauthenticated requests get the right
status code with a message, and the server stays up and answers the next good request. And who may do
what: a job belongs to the token that created it, sessions are capabilities, only members end a job
or report its failures, ring addresses are checked at Join, and peer text is shown escaped."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rendezvous.wire.messages import pb, pb_grpc
from rendezvous.server.store import MemoryStore

from .rdzv_helpers import ServerThread, make_client, server_config, unique, wait_until, wait_world_of

TOKEN = "s3cret-token"
OTHER = "another-tenants-token"   # also accepted by the server: another tenant of the service
AUTH = (("authorization", f"Bearer {TOKEN}"),)
OTHER_AUTH = (("authorization", f"Bearer {OTHER}"),)
FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
METHODS = ["Join", "ReportProgress", "AnswerProbe", "AcknowledgeAbort", "Leave", "ReportFailure", "ReportSuccess",
           "Status"]
# Codes a well-behaved server may answer bad input with; never INTERNAL/UNKNOWN (a bug).
REJECTIONS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ALREADY_EXISTS}


@pytest.fixture(scope="module")
def server():
    s = ServerThread(server_config(insecure=False, tokens=(TOKEN, OTHER), max_jobs=64), MemoryStore)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.address)
    yield pb_grpc.RendezvousStub(channel)
    channel.close()


def assert_alive(stub):
    assert stub.Status(pb.StatusRequest(), timeout=5, metadata=AUTH).leader_id


def code_of(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def good_join(job="good", worker="w0"):
    return pb.JoinRequest(job_id=job, worker_id=worker, host="h", ring_address="127.0.0.1:1234",
                          commit_step=-1, spec=pb.JobSpec(min_np=1, max_np=4))


def test_requests_without_token_are_unauthenticated(stub):
    for method, req in [("Join", good_join()), ("Status", pb.StatusRequest()),
                        ("Leave", pb.LeaveRequest(session_id="good/w0/0"))]:
        code, details = code_of(getattr(stub, method), req, timeout=5)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details, method
    code, _ = code_of(lambda: list(stub.Watch(pb.WatchRequest(session_id="x/y/0"), timeout=5)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert_alive(stub)


@FUZZ
@given(token=st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=64))
def test_wrong_tokens_are_unauthenticated(stub, token):
    md = (("authorization", f"Bearer {token}"),) if token not in (TOKEN, OTHER) else ()
    code, _ = code_of(stub.Join, good_join(), timeout=5, metadata=md)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert_alive(stub)


@pytest.mark.parametrize("field,value", [
    ("job_id", ""), ("job_id", "a/b"), ("job_id", "x" * 129), ("worker_id", "w 1"),
    ("host", ""), ("ring_address", "nohostport"), ("ring_address", "h:0"), ("ring_address", "h:99999"),
    ("commit_step", -2),
    # `$` also matches before a trailing newline: the checks must match the whole value.
    ("job_id", "job\n"), ("worker_id", "w\n"), ("host", "h\n"), ("ring_address", "1.2.3.4:80\n")])
def test_invalid_join_fields_are_named_in_invalid_argument(stub, field, value):
    req = good_join("validation")
    setattr(req, field, value)
    code, details = code_of(stub.Join, req, timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details
    assert_alive(stub)


@pytest.mark.parametrize("spec,expected", [
    (pb.JobSpec(min_np=0, max_np=1), "min_np"), (pb.JobSpec(min_np=3, max_np=2), "max_np"),
    (pb.JobSpec(min_np=1, max_np=1, elastic_timeout_s=-1), "elastic_timeout_s"),
    (pb.JobSpec(min_np=1, max_np=1, elastic_timeout_s=float("nan")), "elastic_timeout_s")])
def test_invalid_job_specs_are_invalid_argument(stub, spec, expected):
    req = good_join("specs")
    req.spec.CopyFrom(spec)
    code, details = code_of(stub.Join, req, timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and expected in details


def test_spec_mismatch_with_existing_job_is_failed_precondition(stub):
    stub.Join(good_join("mismatch", "a"), timeout=5, metadata=AUTH)
    req = good_join("mismatch", "b")
    req.spec.max_np = 7
    code, details = code_of(stub.Join, req, timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "max_np=4" in details


def test_unknown_and_malformed_sessions(stub):
    code, details = code_of(stub.ReportProgress,
                            pb.ReportProgressRequest(session_id=f"nojob/0a1b2c3d/w/{'0' * 48}"),
                            timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.NOT_FOUND and "nojob" in details
    code, details = code_of(stub.ReportProgress, pb.ReportProgressRequest(session_id="nojob/w/0"), timeout=5,
                            metadata=AUTH)   # the old, guessable form
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in details
    code, details = code_of(stub.Leave, pb.LeaveRequest(session_id="garbage"), timeout=5,
                            metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in details
    code, details = code_of(stub.Leave, pb.LeaveRequest(session_id="good/w0/\u00b2"), timeout=5,
                            metadata=AUTH)  # a unicode digit must not reach int()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in details


@FUZZ
@given(field=st.sampled_from(["job_id", "worker_id", "host", "ring_address"]),
       suffix=st.sampled_from(["\n", "\r\n", " ", "\t", "\x00", "\u2028"]))
def test_fuzzed_trailing_characters_after_a_valid_field_are_refused(stub, field, suffix):
    req = good_join("suffixes")
    setattr(req, field, getattr(req, field) + suffix)
    code, details = code_of(stub.Join, req, timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details
    code, details = code_of(stub.Leave, pb.LeaveRequest(session_id="good/w0/0" + suffix),
                            timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in details


def test_oversized_request_is_refused(stub):
    req = good_join("big")
    req.host = "h" * (2 << 20)
    code, _ = code_of(stub.Join, req, timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_alive(stub)


text = st.text(max_size=300)


@FUZZ
@given(job=text, worker=text, host=text, addr=text, step=st.integers(-2 ** 63, 2 ** 63 - 1),
       min_np=st.integers(0, 2 ** 32 - 1), max_np=st.integers(0, 2 ** 32 - 1),
       timeout=st.floats(allow_nan=True, allow_infinity=True))
def test_fuzzed_joins_never_crash_the_server(stub, job, worker, host, addr, step, min_np, max_np,
                                             timeout):
    req = pb.JoinRequest(job_id=job, worker_id=worker, host=host, ring_address=addr,
                         commit_step=step,
                         spec=pb.JobSpec(min_np=min_np, max_np=max_np, elastic_timeout_s=timeout))
    code, details = code_of(stub.Join, req, timeout=5, metadata=AUTH)
    assert code in REJECTIONS | {grpc.StatusCode.OK}, (code, details)
    assert_alive(stub)


@pytest.mark.slow
@FUZZ
@given(session=text, version=st.integers(0, 2 ** 64 - 1), suspect=text, reason=st.text(max_size=2000))
def test_fuzzed_session_calls_never_crash_the_server(stub, session, version, suspect, reason):
    calls = [(stub.ReportProgress, pb.ReportProgressRequest(session_id=session, commit_step=version % 10)),
             (stub.AnswerProbe, pb.AnswerProbeRequest(session_id=session, nonce=version)),
             (stub.AcknowledgeAbort, pb.AcknowledgeAbortRequest(session_id=session, world_version=version)),
             (stub.Leave, pb.LeaveRequest(session_id=session)),
             (stub.ReportSuccess, pb.ReportSuccessRequest(session_id=session)),
             (stub.ReportFailure, pb.ReportFailureRequest(session_id=session, world_version=version,
                                                          suspect_worker_id=suspect,
                                                          reason=reason))]
    for fn, req in calls:
        code, details = code_of(fn, req, timeout=5, metadata=AUTH)
        assert code in REJECTIONS, (code, details)
    code, _ = code_of(lambda: list(stub.Watch(pb.WatchRequest(session_id=session), timeout=5,
                                              metadata=AUTH)))
    assert code in REJECTIONS
    assert_alive(stub)


@FUZZ
@given(method=st.sampled_from(METHODS), payload=st.binary(max_size=512))
def test_fuzzed_raw_bytes_never_crash_the_server(server, stub, method, payload):
    with grpc.insecure_channel(server.address) as ch:
        call = ch.unary_unary(f"/elastic.rendezvous.v1.Rendezvous/{method}")  # bytes in, bytes out
        code, details = code_of(call, payload, timeout=5, metadata=AUTH)
    assert code in REJECTIONS | {grpc.StatusCode.OK}, (code, details)
    if code == grpc.StatusCode.INVALID_ARGUMENT and "malformed request" in details:
        assert method in details
    assert_alive(stub)


# ------------------------------------------------------------------ who may do what
def _member(server, worker, job, **kw):
    """A real worker-side client of the job, joined with TOKEN."""
    c = make_client(server.address, worker, job_id=job, token=TOKEN, **kw)
    c.join()
    return c


def _status(stub, job, auth=AUTH):
    return stub.Status(pb.StatusRequest(job_id=job), timeout=5, metadata=auth).jobs[0]


def test_a_join_with_another_token_is_denied_and_gets_no_secret(server, stub):
    job = unique("owned")
    a = _member(server, "a", job)
    wait_world_of([a], 1)
    for worker in ("a", "intruder"):
        code, details = code_of(stub.Join, good_join(job, worker), timeout=5, metadata=OTHER_AUTH)
        assert code == grpc.StatusCode.PERMISSION_DENIED and job in details, (worker, code, details)
    # Nothing of the job shows to the other token: not in the list, not by name.
    listed = stub.Status(pb.StatusRequest(), timeout=5, metadata=OTHER_AUTH).jobs
    assert job not in [j.job_id for j in listed]
    code, _ = code_of(stub.Status, pb.StatusRequest(job_id=job), timeout=5, metadata=OTHER_AUTH)
    assert code == grpc.StatusCode.NOT_FOUND
    # Even the member's real session is nothing to the other token.
    code, _ = code_of(stub.ReportProgress, pb.ReportProgressRequest(session_id=a.session_id), timeout=5,
                      metadata=OTHER_AUTH)
    assert code == grpc.StatusCode.NOT_FOUND
    assert [m.member.worker_id for m in _status(stub, job).members] == ["a"]
    a.close()


def test_ring_secrets_are_random_per_job_and_shared_by_its_members(server):
    import hashlib
    import hmac as hmac_

    jobs = [unique("secret"), unique("secret")]
    clients = [_member(server, w, j) for j in jobs for w in ("a", "b")]
    secrets = [c.ring_secret for c in clients]
    assert all(len(s) == 32 for s in secrets)
    assert secrets[0] == secrets[1] and secrets[2] == secrets[3] and secrets[0] != secrets[2]
    for job, secret in zip(jobs, secrets[::2]):   # not the old derivation, with or without a token
        for token in (TOKEN, ""):
            derived = hmac_.new(token.encode(), f"elastic-ring ring secret:{job}".encode(),
                                hashlib.sha256)
            assert secret not in (derived.digest(), derived.hexdigest().encode())
    for c in clients:
        c.close()


def _forged_sessions(real: str) -> list[str]:
    parts = real.split("/")
    job, worker, run = parts[0], parts[-2], parts[1] if len(parts) == 4 else "0a1b2c3d"
    return [f"{job}/{worker}/0", f"{job}/{worker}/1",          # the old, guessable form
            f"{job}/{run}/{worker}/{'0' * 48}",                # the right form, a guessed secret
            f"{job}/{run}/{worker}/{real[-48:][::-1]:0>48}",
            real[:-1] + ("0" if real[-1] != "0" else "1")]     # one character off


@pytest.mark.slow
def test_forged_or_guessed_session_ids_are_refused_on_every_session_rpc(server, stub):
    job = unique("sessions")
    a = _member(server, "a", job)
    world = wait_world_of([a], 1)[0]
    for sid in _forged_sessions(a.session_id):
        calls = [(stub.ReportProgress, pb.ReportProgressRequest(session_id=sid, commit_step=5)),
                 (stub.AnswerProbe, pb.AnswerProbeRequest(session_id=sid, nonce=1)),
                 (stub.AcknowledgeAbort, pb.AcknowledgeAbortRequest(session_id=sid, world_version=1)),
                 (stub.ReportFailure, pb.ReportFailureRequest(session_id=sid, world_version=1,
                                                              suspect_worker_id="a")),
                 (stub.ReportSuccess, pb.ReportSuccessRequest(session_id=sid, world_version=1)),
                 (stub.Leave, pb.LeaveRequest(session_id=sid))]
        for fn, req in calls:
            code, details = code_of(fn, req, timeout=5, metadata=AUTH)
            assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), \
                (sid, fn, code, details)
            assert sid[-48:] not in details   # a session is never echoed
        code, _ = code_of(lambda: list(stub.Watch(pb.WatchRequest(session_id=sid), timeout=5,
                                                  metadata=AUTH)))
        assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), (sid, code)
    st = _status(stub, job)
    assert st.phase == "RUNNING" and st.world_version == world.world_version
    assert [(m.member.worker_id, m.attached) for m in st.members] == [("a", True)]
    assert a.next_event(0.3) is None          # the real worker heard nothing
    assert a.report_progress(commit_step=3) == world.world_version   # and its own session still works
    a.close()


@pytest.mark.slow
@pytest.mark.parametrize("session", ["", "forged"], ids=["no session", "made-up session"])
def test_a_join_naming_a_live_worker_without_its_session_is_refused_and_it_stays(server, stub, session):
    job = unique("takeover")
    a = _member(server, "a", job)
    world = wait_world_of([a], 1)[0]
    req = good_join(job, "a")
    req.ring_address = "127.0.0.1:4444"
    req.ClearField("spec")
    if session:
        req.session_id = f"{job}/{a.session_id.split('/')[1]}/a/{'1' * 48}"
    code, details = code_of(stub.Join, req, timeout=5, metadata=AUTH)
    assert code == grpc.StatusCode.ALREADY_EXISTS and "session_id" in details and "a" in details
    st = _status(stub, job)
    assert [(m.member.worker_id, m.member.ring_address, m.attached) for m in st.members] == \
        [("a", a.ring_address, True)]
    assert st.world_version == world.world_version
    assert a.next_event(0.3) is None
    assert a.report_progress() == world.world_version
    a.join()   # the worker itself, with its session, may
    assert a.wait_world(timeout_s=5.0, min_version=world.world_version + 1).peers[0].worker_id == "a"
    a.close()


@pytest.mark.slow
def test_report_success_from_a_worker_outside_the_world_does_not_end_the_job(server, stub):
    from rendezvous.common.channel import RendezvousRPCError
    from rendezvous.wire.membership import JobSpec
    from rendezvous.client.watch_events import Standby
    job = unique("success")
    spec = JobSpec(min_np=1, max_np=1)
    a = _member(server, "a", job, spec=spec)
    world = wait_world_of([a], 1)[0]
    spare = _member(server, "spare", job, spec=spec)   # beyond max_np: a hot spare, in no world
    assert isinstance(spare.next_event(5.0), Standby)
    with pytest.raises(RendezvousRPCError) as e:   # it has seen no world: it names none
        spare.report_success()
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "not a member" in str(e.value)
    for version in (world.world_version, world.world_version + 1):   # nor may it name one it is not in
        with pytest.raises(RendezvousRPCError) as e:
            spare.report_success(world_version=version)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "not a member" in str(e.value)
    with pytest.raises(RendezvousRPCError) as e:   # nor report a member's failure
        spare.report_failure("a", world.world_version, "made up")
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert _status(stub, job).phase == "RUNNING"
    assert a.next_event(0.3) is None
    a.report_success()   # a member's report does end it
    assert _status(stub, job).phase == "SUCCEEDED"
    a.close()
    spare.close()


@pytest.mark.parametrize("address,why", [
    ("0.0.0.0:5000", "wildcard"), ("[::]:5000", "wildcard"), ("0.0.0.0:1", "wildcard"),
    (":5000", "HOST:PORT"), ("127.0.0.1:0", "port 1..65535"), ("127.0.0.1:65536", "port 1..65535"),
    ("no-such-host.invalid:5000", "resolve"), ("224.0.0.1:5000", "wildcard"),
    ("[::ffff:0.0.0.0]:5000", "wildcard"), ("255.255.255.255:5000", "wildcard"),
    ("[127.0.0.1:5000", "HOST:PORT")])
def test_a_ring_address_no_peer_could_connect_to_is_refused_at_join(stub, address, why):
    req = good_join("addresses", "w-bad")
    req.ring_address = address
    code, details = code_of(stub.Join, req, timeout=10, metadata=AUTH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ring_address" in details and why in details, \
        (code, details)
    assert_alive(stub)


@pytest.mark.parametrize("address", ["localhost:5000", "127.0.0.1:5000", "[::1]:5000"])
def test_connectable_ring_addresses_are_accepted(stub, address):
    req = good_join("addresses-ok", f"w{abs(hash(address))}")
    req.ring_address = address
    code, details = code_of(stub.Join, req, timeout=10, metadata=AUTH)
    assert code == grpc.StatusCode.OK, details


@pytest.mark.slow
def test_joins_that_never_watch_do_not_hold_the_job_cap():
    s = ServerThread(server_config(max_jobs=2, heartbeat_timeout_s=0.5), MemoryStore)
    try:
        with grpc.insecure_channel(s.address) as ch:
            raw = pb_grpc.RendezvousStub(ch)
            for _ in range(2):   # joins that never open their Watch hold both places...
                raw.Join(good_join(unique("squat"), "w"), timeout=5)
            code, _ = code_of(raw.Join, good_join(unique("real"), "w"), timeout=5)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            # ...only until the heartbeat timeout: then those jobs are dropped.
            wait_until(lambda: not raw.Status(pb.StatusRequest(), timeout=5).jobs, 5.0,
                       "the unwatched jobs to be dropped")
            raw.Join(good_join(unique("real"), "w"), timeout=5)
    finally:
        s.stop()


@pytest.mark.slow
def test_a_watched_forming_job_is_not_dropped():
    from rendezvous.wire.membership import JobSpec
    from rendezvous.client.watch_events import Standby
    s = ServerThread(server_config(heartbeat_timeout_s=0.5), MemoryStore)
    try:
        job = unique("forming")
        a = make_client(s.address, "a", job_id=job, spec=JobSpec(min_np=2, max_np=2))
        a.join()
        assert isinstance(a.next_event(5.0), Standby)
        assert a.next_event(1.5) is None       # three heartbeat timeouts: still waiting for a peer
        with grpc.insecure_channel(s.address) as ch:
            st = pb_grpc.RendezvousStub(ch).Status(pb.StatusRequest(job_id=job), timeout=5).jobs[0]
        assert st.phase == "FORMING" and [m.member.worker_id for m in st.members] == ["a"]
        a.close()
    finally:
        s.stop()


@pytest.mark.slow
def test_a_finished_job_is_launched_again_by_its_own_token_only():
    from rendezvous.common.channel import RendezvousRPCError
    s = ServerThread(server_config(insecure=False, tokens=(TOKEN, OTHER), heartbeat_timeout_s=0.5,
                                   leader_ttl_s=1), MemoryStore)
    try:
        job = unique("again")
        a = make_client(s.address, "a", job_id=job, token=TOKEN)
        a.join()
        wait_world_of([a], 1)
        first_secret = a.ring_secret
        a.report_success()
        with pytest.raises(RendezvousRPCError) as e:   # a member learns how it ended, not a new run
            a.join()
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and e.value.finished is True
        stranger = make_client(s.address, "a", job_id=job, token=OTHER)
        again = make_client(s.address, "a", job_id=job, token=TOKEN)

        def relaunched():
            with pytest.raises(RendezvousRPCError) as e:
                stranger.join(timeout_s=2)
            assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
            try:
                again.join(timeout_s=2)
            except RendezvousRPCError as e:
                assert e.code == grpc.StatusCode.FAILED_PRECONDITION, e
                return False
            return True
        wait_until(relaunched, 10.0, "a new run of the finished job")
        world = wait_world_of([again], 1)[0]
        assert world.world_version == 1 and again.ring_secret != first_secret
        for c in (a, stranger, again):
            c.close()
    finally:
        s.stop()


def test_peer_supplied_failure_reasons_are_escaped_and_shortened(server, stub, caplog):
    import logging

    from rendezvous.client.watch_events import Abort
    caplog.set_level(logging.INFO, logger="rendezvous.server.service")
    job = unique("reasons")
    a, b = _member(server, "a", job), _member(server, "b", job)
    world = wait_world_of([a, b], 2)[0]
    forged = "timeout\n2030-01-01 INFO rendezvous.server.service: job x: world 9 announced\x1b[2J\u202e" + "A" * 900
    assert a.report_failure("b", world.world_version, forged) is False   # b is alive: answers the probe
    abort = next(ev for ev in iter(lambda: a.next_event(5.0), None) if isinstance(ev, Abort))
    for text in (abort.reason, caplog.text):
        assert "\x1b" not in text and "\u202e" not in text
        assert "\nworld 9" not in text and "\n2030" not in text
    assert "timeout\\n2030" in abort.reason and "\\x1b[2J" in abort.reason
    assert len(abort.reason) < 400
    a.close()
    b.close()


def test_a_token_file_holds_one_token_a_line_and_a_one_token_file_still_works(tmp_path):
    from rendezvous.common.channel import read_token_list
    from rendezvous.server.server_config import ServerConfig
    one, two, empty = tmp_path / "one", tmp_path / "two", tmp_path / "empty"
    one.write_text("tok-123\n")
    two.write_text("tenant-a\n\n  tenant-b  \n")
    empty.write_text("\n \n")
    assert read_token_list(str(one), "token file") == ("tok-123",)
    assert read_token_list(str(two), "token file") == ("tenant-a", "tenant-b")
    with pytest.raises(ValueError, match="is empty"):
        read_token_list(str(empty), "token file")
    with pytest.raises(ValueError, match="token 2 has characters"):
        ServerConfig(tokens=("ok", "has space")).validate()


def test_a_running_job_stored_by_an_older_server_is_refused_not_joined_without_a_secret():
    import asyncio
    import json
    import time

    from rendezvous.server import decision as d
    from rendezvous.server import job_json
    state = json.loads(job_json.to_json(d.new_job("legacy", d.JobSpec(1, 4, 60.0), time.time())))
    for field in ("credential", "ring_secret", "run"):   # what an older server wrote
        del state[field]
    store = MemoryStore()
    config = server_config()
    asyncio.run(store.put(f"{config.etcd_prefix}/jobs/legacy", json.dumps(state).encode()))
    s = ServerThread(config, lambda: store)
    try:
        with grpc.insecure_channel(s.address) as ch:
            code, details = code_of(pb_grpc.RendezvousStub(ch).Join, good_join("legacy", "w"), timeout=5)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "older server" in details
    finally:
        s.stop()


@pytest.mark.slow
def test_one_tokens_hanging_name_lookups_do_not_hold_another_tenants_joins(stub, monkeypatch):
    # A zone that never answers: every lookup of a *.hang.test name blocks until released.
    import socket
    import threading
    import time

    from rendezvous.server import request_checks
    release = threading.Event()
    real = socket.getaddrinfo

    def getaddrinfo(host, *a, **kw):
        if str(host).endswith(".hang.test"):
            release.wait(30)
            raise socket.gaierror(socket.EAI_NONAME, "released")
        return real(host, *a, **kw)

    monkeypatch.setattr(request_checks.socket, "getaddrinfo", getaddrinfo)
    try:
        codes = []
        for i in range(6):   # more than the pool has threads, all from the other tenant
            req = good_join("hang-b", f"b{i}")
            req.ring_address = f"n{i}.hang.test:5000"
            codes.append(code_of(stub.Join, req, timeout=10, metadata=OTHER_AUTH)[0])
        # Its own lookups time out (INVALID_ARGUMENT naming the name) or find no slot.
        assert set(codes) <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        req = good_join("hang-a", "a0")
        req.ring_address = "localhost:5001"
        started = time.monotonic()
        code, details = code_of(stub.Join, req, timeout=10, metadata=AUTH)
        assert code == grpc.StatusCode.OK, details
        assert time.monotonic() - started < request_checks.RESOLVE_TIMEOUT_S + 0.5
    finally:
        release.set()
