"""What the launcher reports, as a function of Status answers and local events (no processes)."""

import pytest

from elastic.launch.discovery import DiscoveryError, local_slots, parse_hosts
from elastic.launch.outcome import WorkerEnd, completion_failure
from elastic.launch.procs import DIVERGED_LIMIT, ExitPlan, describe_exit, exception_line, plan_exit, signal_of
from elastic.launch.report import Reporter
import dataclasses

from rendezvous.client.status_client import JobEventInfo, JobStatusInfo, MemberStatusInfo


def view(version, ranked, standby=(), phase="RUNNING", min_np=1, stepped=True):
    """``stepped``: every member has trained a step in this world (False: none has yet)."""
    members = tuple(MemberStatusInfo(w, "h", r, True, 0, stepped_world=version if stepped else version - 1)
                    for r, w in enumerate(ranked))
    members += tuple(MemberStatusInfo(w, "h", None, True, -1) for w in standby)
    return JobStatusInfo("job", phase, "", version, min_np, 8, 600.0, members)


def test_first_world_is_reported_with_the_time_since_launch():
    r = Reporter(now=100.0)
    assert r.update(view(0, [], standby=["a", "b"], phase="FORMING"), 100.5) == []
    assert r.update(view(1, ["a", "b"]), 101.25) == ["world 1: 2 worker(s), formed 1.25 s after launch"]


def test_a_failure_is_reported_with_who_left_and_the_recovery_time():
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b", "c"]), 1.0)
    r.note_failure("b killed by SIGKILL", 10.0)
    # b already gone from Status at the same version: still reported as having left at the next world
    assert r.update(view(1, ["a", "c"]), 10.1) == []
    assert r.update(view(2, ["a", "c"]), 10.4) == [
        "world 2: 2 worker(s); left: b; recovered 0.40 s after b killed by SIGKILL"]
    assert r.recoveries == [pytest.approx(0.4)]


def test_a_recovery_is_counted_to_the_first_step_every_member_of_the_new_world_trained():
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b", "c"]), 1.0)
    r.note_failure("b killed by SIGKILL", 10.0)
    assert r.update(view(2, ["a", "c"], stepped=False), 10.05) == []    # formed, nobody stepped yet
    half = view(2, ["a", "c"])
    half = dataclasses.replace(half, members=(half.members[0], dataclasses.replace(half.members[1], stepped_world=1)))
    assert r.update(half, 10.2) == []                                   # one of the two stepped
    assert r.update(view(2, ["a", "c"]), 10.4) == [
        "world 2: 2 worker(s); left: b; recovered 0.40 s after b killed by SIGKILL"]
    assert r.recoveries == [pytest.approx(0.4)]


def test_a_world_that_reports_no_step_is_said_formed_after_a_while():
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b"]), 1.0)
    r.note_failure("b killed by SIGKILL", 10.0)
    assert r.update(view(2, ["a"], stepped=False), 10.3) == []
    assert r.update(view(2, ["a"], stepped=False), 40.5) == [
        "world 2: 1 worker(s); left: b; formed 0.30 s after b killed by SIGKILL; no training step reported in 30 s"]
    assert r.recoveries == [pytest.approx(0.3)]


@pytest.mark.parametrize("stepped, line", [
    (True, "world 2: 1 worker(s); left: b; recovered 0.50 s after b killed by SIGKILL"),
    (False, "world 2: 1 worker(s); left: b; formed 0.20 s after b killed by SIGKILL; the job ended before "
            "every member reported a training step in it"),
])
def test_a_world_held_for_its_first_step_is_said_when_the_job_ends(stepped, line):
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b"]), 1.0)
    r.note_failure("b killed by SIGKILL", 10.0)
    assert r.update(view(2, ["a"], stepped=False), 10.2) == []
    assert r.update(view(2, ["a"], phase="SUCCEEDED", stepped=stepped), 10.5) == [line]
    assert len(r.recoveries) == 1


def test_a_newer_world_before_the_first_step_carries_the_recovery_on():
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b", "c"]), 1.0)
    r.note_failure("b killed by SIGKILL", 10.0)
    assert r.update(view(2, ["a", "c"], stepped=False), 10.2) == []
    assert r.update(view(3, ["a", "c", "b2"]), 11.0) == [
        "world 2: 2 worker(s); left: b; formed 0.20 s after b killed by SIGKILL",
        "world 3: 3 worker(s); joined: b2; recovered 1.00 s after b killed by SIGKILL"]


def test_a_remote_failure_starts_the_clock_when_status_shows_the_member_gone():
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b"]), 1.0)
    r.update(view(1, ["a"]), 5.0)
    assert r.update(view(2, ["a"]), 5.5) == ["world 2: 1 worker(s); left: b; recovered 0.50 s after b left the world"]


@pytest.mark.parametrize("status_first", [True, False])
def test_a_local_worker_killed_is_reported_as_killed_whichever_is_seen_first(status_first):
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b"]), 1.0)
    if status_first:   # Status shows it gone before the launcher reaps its SIGKILL
        r.update(view(1, ["a"]), 5.0)
        r.note_failure("b killed by SIGKILL", 5.2, frozenset({"b"}))
    else:
        r.note_failure("b killed by SIGKILL", 5.0, frozenset({"b"}))
        r.update(view(1, ["a"]), 5.2)
    assert r.update(view(2, ["a"]), 5.5) == [
        "world 2: 1 worker(s); left: b; recovered 0.50 s after b killed by SIGKILL"]


def test_a_local_exit_does_not_replace_a_failure_of_more_workers_than_it_names():
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b", "c"]), 1.0)
    r.update(view(1, ["a"]), 5.0)
    r.note_failure("b killed by SIGKILL", 5.2, frozenset({"b"}))
    assert r.update(view(2, ["a"]), 5.5) == [
        "world 2: 1 worker(s); left: b, c; recovered 0.50 s after b, c left the world"]


@pytest.mark.parametrize("status_first", [True, False])
def test_a_local_worker_that_left_gracefully_is_no_failure_whichever_is_seen_first(status_first):
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b"]), 1.0)
    if status_first:   # Status shows it gone before the launcher reaps its exit 0
        r.update(view(1, ["a"]), 5.0)
        r.note_left("b")
    else:
        r.note_left("b")
        r.update(view(1, ["a"]), 5.0)
    assert r.update(view(2, ["a"]), 5.5) == ["world 2: 1 worker(s); left: b"]
    assert r.recoveries == []


def test_a_world_re_formed_with_every_member_alive_says_why_and_counts_as_a_recovery():
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b"]), 1.0)
    broken = JobEventInfo(40.0, "ring_broken", 1, "a", "collective timeout waiting on rank 0 (a), every member alive")
    assert r.update(dataclasses.replace(view(1, ["a", "b"]), events=(broken,)), 40.2) == []
    # Seen again in the next answers (the last events come with every one): one failure, noted once.
    assert r.update(dataclasses.replace(view(2, ["a", "b"]), events=(broken,)), 40.5) == [
        "world 2: 2 worker(s); recovered 0.30 s after collective timeout waiting on rank 0 (a), every member alive"]
    assert r.update(dataclasses.replace(view(3, ["a", "b"]), events=(broken,)), 50.0) == ["world 3: 2 worker(s)"]
    assert r.recoveries == [pytest.approx(0.3)]


@pytest.mark.parametrize("event,reported", [
    ("worker_left", "world 2: 1 worker(s); left: b"),
    ("straggler_left", "world 2: 1 worker(s); left: b"),
    ("worker_evicted", "world 2: 1 worker(s); left: b; recovered 0.50 s after b left the world"),
])
def test_the_servers_events_tell_a_leave_from_a_failure_before_any_exit_is_seen(event, reported):
    # b runs on another host, or its process has not exited yet when the next world comes:
    # only the server's event says whether it left or failed.
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b"]), 1.0)
    gone = dataclasses.replace(view(1, ["a"]), events=(JobEventInfo(4.9, event, 1, "b"),))
    r.update(gone, 5.0)
    assert r.update(dataclasses.replace(view(2, ["a"]), events=gone.events), 5.5) == [reported]
    assert len(r.recoveries) == (event == "worker_evicted")


def test_a_join_is_reported_with_the_time_since_the_worker_started_and_no_recovery():
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b"]), 1.0)
    r.note_start("c", 2.0)
    assert r.update(view(1, ["a", "b"], standby=["c"]), 2.5) == []
    assert r.update(view(2, ["a", "b", "c"]), 4.0) == ["world 2: 3 worker(s); joined: c (2.00 s after start)"]
    assert r.recoveries == []


def test_waiting_below_min_np_and_coming_back_are_reported_once_it_lasts():
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b"], min_np=2), 1.0)
    assert r.update(view(1, ["a"], phase="WAITING", min_np=2), 2.0) == []
    assert r.update(view(1, ["a"], phase="WAITING", min_np=2), 2.5) == []
    assert r.update(view(1, ["a"], phase="WAITING", min_np=2), 3.0) == [
        "below min-np=2: 1 worker(s) left; the job fails if it stays below for 600 s"]
    assert r.update(view(1, ["a"], phase="WAITING", min_np=2), 4.0) == []
    assert r.update(view(2, ["a", "b2"], min_np=2), 5.0)[-1] == "back at 2 worker(s), at least min-np=2"


def test_a_job_below_min_np_only_on_its_way_out_says_nothing_of_it():
    # A worker's exception stops the launcher: Status shows WAITING for a moment before the end.
    r = Reporter(now=0.0)
    r.update(view(1, ["a", "b"], min_np=2), 1.0)
    assert r.update(view(1, ["a"], phase="WAITING", min_np=2), 2.0) == []
    assert r.update(view(2, ["a", "b2"], min_np=2), 2.5) == [
        "world 2: 2 worker(s); left: b; joined: b2; recovered 0.50 s after b left the world"]


def test_ranks_come_from_status_and_outlive_the_worker_s_place_in_it():
    r = Reporter(now=0.0)
    assert r.rank_of("b") is None
    r.update(view(1, ["a", "b"], standby=["c"]), 1.0)
    assert (r.rank_of("a"), r.rank_of("b"), r.rank_of("c")) == (0, 1, None)
    r.update(view(1, ["a"], standby=["c"]), 2.0)         # b gone: its failure still names rank 1
    assert r.rank_of("b") == 1
    r.update(view(2, ["c", "a"]), 3.0)
    assert (r.rank_of("a"), r.rank_of("c")) == (1, 0)


@pytest.mark.parametrize("text, hosts", [
    ("a:2\nb\n", {"a": 2, "b": 1}),
    ("  a:2  \n\n# comment\nb:4 # trailing\n", {"a": 2, "b": 4}),
    ("a:1\na:2\n", {"a": 3}),
    ("", {}),
])
def test_discovery_output_is_parsed_as_host_slots_lines(text, hosts):
    assert parse_hosts(text) == hosts


@pytest.mark.parametrize("text", ["a:b\n", "a:2:3\n", "a b\n"])
def test_malformed_discovery_lines_are_refused_with_the_line_number(text):
    with pytest.raises(DiscoveryError, match="line 1"):
        parse_hosts(text)


def test_local_slots_count_every_name_of_this_host():
    assert local_slots({"node1": 2, "localhost": 1, "node2": 8}, ["node1", "localhost"]) == 3


@pytest.mark.parametrize("code, text, sig", [
    (-9, "killed by SIGKILL", 9), (137, "killed by SIGKILL", 9), (1, "exited with status 1", None),
    (0, "exited with status 0", None),
    (76, "exited with status 76 (outvoted: it called other collectives, or formed its ring with other settings, "
         "than the majority of its world)", None),
])
def test_exit_statuses_are_described_and_signals_recognised(code, text, sig):
    assert describe_exit(code) == text
    assert signal_of(code) == sig


@pytest.mark.parametrize("code, restarts, max_restarts, outvoted, plan", [
    # its own error ends the launcher
    (1, 0, 3, 0, ExitPlan(False, fail=True)),
    (0, 0, 3, 0, ExitPlan(False, fail=True)),
    # killed by a signal, or wedged in a device abort: respawned while restarts are left
    (-9, 0, 3, 0, ExitPlan(True, 0.5, "respawning it in 0.5 s (restart 1 of 3)")),
    (75, 2, 3, 0, ExitPlan(True, 2.0, "respawning it in 2.0 s (restart 3 of 3)")),
    (137, 3, 3, 0, ExitPlan(False, note="not respawned (--max-restarts 3 used up)")),
    (-9, 0, 0, 0, ExitPlan(False, note="not respawned (--max-restarts 0)")),
    # outvoted: respawned (a branch may not diverge again) until the slot was outvoted 3 times
    (76, 0, 3, 0, ExitPlan(True, 0.5, "respawning it in 0.5 s (restart 1 of 3, outvoted 1 of 3 times)")),
    (76, 1, 3, 1, ExitPlan(True, 1.0, "respawning it in 1.0 s (restart 2 of 3, outvoted 2 of 3 times)")),
    (76, 2, 9, 2, ExitPlan(False, note="not respawned: outvoted 3 times (check that every host runs the same "
                                       "program and image with the same ELASTIC_* ring settings); the job goes on "
                                       "without it")),
    (76, 1, 1, 1, ExitPlan(False, note="not respawned (--max-restarts 1 used up)")),
])
def test_what_elastic_run_does_about_a_worker_that_exited_while_the_job_ran(code, restarts, max_restarts, outvoted,
                                                                            plan):
    assert DIVERGED_LIMIT == 3
    assert plan_exit(code, restarts, max_restarts, outvoted) == plan


def test_the_reason_of_a_failed_worker_is_its_exception_line_even_with_noise_after_it():
    lines = ["Traceback (most recent call last):", '  File "t.py", line 3, in <module>',
             "elastic.WorkerLostError: forming world version 1 aborted",
             "nanobind: leaked 2 instances!", "See https://nanobind.readthedocs.io/en/latest/refleaks.html"]
    assert exception_line(lines) == "elastic.WorkerLostError: forming world version 1 aborted"
    assert exception_line(["ValueError: bad input"]) == "ValueError: bad input"
    assert exception_line(["something went wrong", "exiting"]) == "exiting"
    assert exception_line([]) == ""
    assert exception_line(["INFO elastic: worker w is rank 1", "exiting"], fallback=False) == ""


def ended(*ends):
    return completion_failure(ends, "job", 30.0)


def test_the_launcher_succeeds_when_every_worker_exited_0():
    assert ended(WorkerEnd("a", 0, 0), WorkerEnd("b", 1, 0)) is None


def test_a_worker_killed_while_the_job_ran_is_a_recovered_failure_not_the_launcher_s():
    assert ended(WorkerEnd("b", 1, -9, during_job=True), WorkerEnd("a", 0, 0), WorkerEnd("b-r1", 1, 0)) is None


def test_a_worker_that_left_gracefully_or_was_stopped_by_the_launcher_counts_as_success():
    assert ended(WorkerEnd("a", 0, 0), WorkerEnd("b", 1, -15, left=True), WorkerEnd("c", None, -15, stopped=True)) is None


def test_a_worker_exiting_non_zero_after_the_job_completed_fails_the_launcher_naming_it():
    assert ended(WorkerEnd("a", 0, 0), WorkerEnd("b", 1, 3)) == "worker b (rank 1) exited with status 3 after job job completed"


def test_the_first_worker_that_failed_is_named_with_its_error_line_then_the_others():
    assert ended(WorkerEnd("a", None, 1, error="RuntimeError: boom"), WorkerEnd("b", 1, 3)) == (
        "worker a exited with status 1 after job job completed: RuntimeError: boom; "
        "also worker b (rank 1) exited with status 3 after job job completed")


def test_after_a_skipped_final_barrier_the_line_carries_the_error_that_names_the_member():
    # The honest worker that exited first was told of a failure further on; the one after the
    # member on the ring names it; the member itself slept past the launcher's wait.
    line = ended(WorkerEnd("w0", 1, 1, error="WorkerLostError: barrier on the ring kept after the run failed: ..."),
                 WorkerEnd("w1", 0, 1, error="WorkerLostError: worker s (rank 2) did not arrive at barrier"),
                 WorkerEnd("s", 2, None))
    assert line == ("worker w0 (rank 1) exited with status 1 after job job completed: WorkerLostError: barrier on "
                    "the ring kept after the run failed: ...; also worker w1 (rank 0) exited with status 1 after "
                    "job job completed: WorkerLostError: worker s (rank 2) did not arrive at barrier; also worker s "
                    "(rank 2) was still running 30 s after job job completed (stopped)")


def test_past_the_workers_shown_the_others_are_counted():
    line = ended(*(WorkerEnd(f"w{i}", i, 1) for i in range(6)))
    assert line.count("; also ") == 3 and line.endswith("; and 2 more") and "w4" not in line, line


def test_a_signal_after_the_job_completed_is_a_failure_too():
    assert ended(WorkerEnd("a", 0, -9)) == "worker a (rank 0) killed by SIGKILL after job job completed"


def test_a_worker_still_running_when_the_launcher_stops_waiting_is_a_failure():
    assert ended(WorkerEnd("a", 0, 0), WorkerEnd("b", 1, None)) == (
        "worker b (rank 1) was still running 30 s after job job completed (stopped)")


@pytest.mark.parametrize("times, hurry, echo_after", [
    ([0.0], False, None),
    ([0.0, 0.004], False, 0.004),            # a wrapper forwarding the same Ctrl-C
    ([0.0, 0.004, 0.5], False, 0.004),
    ([0.0, 1.0], True, None),                # a person's second Ctrl-C
    ([0.0, 0.01, 2.5], True, 0.01),
])
def test_a_repeat_signal_within_a_second_is_an_echo_of_the_first(times, hurry, echo_after):
    from elastic.launch.signals import StopSignals

    s = StopSignals()
    for t in times:
        s.record(2, 100.0 + t)
    assert s.hurry is hurry
    assert s.echo_after == (pytest.approx(echo_after) if echo_after is not None else None)
    line = s.echo_line("SIGINT")
    assert (line is not None) is (echo_after is not None) and s.echo_line("SIGINT") is None


def test_a_job_waiting_for_late_workers_says_how_many_every_ten_seconds():
    r = Reporter(now=0.0)
    one = dataclasses.replace(view(0, [], standby=["a"], phase="FORMING", min_np=2))
    assert r.update(one, 1.0) == []
    assert r.update(one, 10.9) == []
    assert r.update(one, 11.0) == ["waiting for 1 more worker: 1 of min-np 2 joined, 10 s (the job fails after "
                                   "600 s below min-np)"]
    assert r.update(one, 15.0) == []
    lines = r.update(one, 21.0)
    assert lines == ["waiting for 1 more worker: 1 of min-np 2 joined, 20 s (the job fails after 600 s below "
                     "min-np)"] and not lines[0].notable
    # Enough workers: a world forms and the waiting lines stop.
    assert r.update(view(1, ["a", "b"], min_np=2), 22.0) == ["world 1: 2 worker(s), formed 22.00 s after launch"]
    assert r.update(view(1, ["a", "b"], min_np=2), 40.0) == []


def test_routine_lines_are_not_notable_and_failures_are():
    r = Reporter(now=0.0)
    assert not any(line.notable for line in r.update(view(1, ["a", "b"]), 1.0))
    r.note_failure("b killed by SIGKILL", 2.0)
    assert all(line.notable for line in r.update(view(2, ["a"]), 2.5))
