"""The launcher's side of straggler detection, as rules (elastic/launch/straggler_watch.py): its flags,
which of its workers it names and when, what becomes of the slot of one that left as a straggler,
and that no respawn goes to a host in the blacklist cooldown."""

import sys

import pytest

from elastic.launch.flags import UsageError, parse
from elastic.launch.straggler_watch import StragglerWatch, host_cooling
from elastic.runtime.straggler_detector import StragglerConfig
from rendezvous.client.status_client import JobEventInfo, JobStatusInfo, MemberStatusInfo


def view(version=2, events=(), blacklisted=()):
    members = tuple(MemberStatusInfo(w, "hA" if w.startswith("hA") else "hB", r, True, 10)
                    for r, w in enumerate(("hA-0", "hA-1", "hB-0")))
    return JobStatusInfo("j", "RUNNING", "", version, 2, 8, 60.0, members, tuple(blacklisted), tuple(events))


LOCAL = {"hA-0", "hA-1"}


def flags(*args):
    return parse(["--np", "2", *args, "--", sys.executable, "-c", "pass"], env={})


def test_the_straggler_flags_fill_the_settings_the_workers_get():
    assert flags().stragglers == StragglerConfig()
    cfg = flags("--straggler-policy", "EVICT", "--straggler-factor", "2", "--straggler-windows", "5",
                "--straggler-window", "0.5")
    assert cfg.stragglers == StragglerConfig("evict", 2.0, 5, 0.5)
    assert cfg.stragglers.to_env()["ELASTIC_STRAGGLER_POLICY"] == "evict"


@pytest.mark.parametrize("args, message", [
    (["--straggler-factor", "1"], "--straggler-factor 1.0: must be above 1 (times the median) and at most 100"),
    (["--straggler-factor", "nan"], "--straggler-factor nan: not a finite number"),
    (["--straggler-windows", "0"], "--straggler-windows 0: must be a whole number of windows from 1 to 1000"),
    (["--straggler-window", "-1"], "--straggler-window -1.0: must be in (0, 3600] seconds"),
    (["--straggler-policy", "kill"], "argument --straggler-policy: invalid choice: 'kill'"),
])
def test_a_bad_straggler_flag_is_refused_naming_it(args, message):
    with pytest.raises(UsageError) as e:
        flags(*args)
    assert str(e.value).startswith(message)


def detected(worker, version=2, rank=1, factor=2.04, windows=3):
    return JobEventInfo(1.0, "straggler_detected", version, worker, f"{factor:.2f}x the median compute",
                        {"rank": rank, "factor": factor, "windows": windows})


def test_a_local_straggler_is_named_once_per_world_from_the_servers_event():
    watch = StragglerWatch("report", "hA")
    (named,) = watch.update(view(events=(detected("hA-1"),)), LOCAL)
    assert named.fields == {"worker_id": "hA-1", "rank": 1, "factor": 2.04, "windows": 3, "policy": "report"}
    assert named.line == ("worker hA-1 (rank 1) on host hA is a straggler: it computed 2.04x the median of world 2 "
                          "for 3 commit windows in a row (--straggler-policy report: it stays)")
    # The recent events come with every answer: still world 2, nothing new.
    assert watch.update(view(events=(detected("hA-1"),)), LOCAL) == []
    again = watch.update(view(3, events=(detected("hA-1"), detected("hA-1", 3, factor=1.9))), LOCAL)
    assert [(n.fields["worker_id"], n.fields["factor"]) for n in again] == [("hA-1", 1.9)]   # a new world


def test_a_straggler_that_already_left_is_still_named():
    watch = StragglerWatch("evict", "hA")
    gone = view(events=(detected("hA-1"), JobEventInfo(1.1, "straggler_left", 2, "hA-1")))
    (named,) = watch.update(gone, LOCAL)
    assert named.line.endswith("(--straggler-policy evict: it leaves at its next commit unless the job would drop "
                               "below --min-np with no spare to take its place)")


def test_only_this_hosts_workers_are_named_here():
    watch = StragglerWatch("evict", "hA")
    assert watch.update(view(events=(detected("hB-0"),)), LOCAL) == []


def test_a_worker_that_left_as_a_straggler_is_known_by_the_servers_event_and_its_slot_retired():
    watch = StragglerWatch("evict", "hA")
    gone = view(events=(JobEventInfo(1.0, "straggler_left", 2, "hA-1"), JobEventInfo(1.0, "worker_left", 2, "hA-0")))
    assert watch.left("hA-0", 0, gone) is None                 # left for another reason (SIGTERM, say)
    assert watch.left("hA-1", 1, gone) == (
        "left as a straggler (--straggler-policy evict); slot 1 is retired, not respawned: host hA is the slow spot "
        "(it cools down in the rendezvous blacklist); a spare on another host, if one stands by, takes the place")
    # Known from an earlier answer too: the event may have scrolled out of the recent ones.
    assert watch.left("hA-1", 1, view()) is not None


def test_no_respawn_goes_to_a_host_in_the_blacklist_cooldown():
    assert host_cooling(view(blacklisted=("hA",)), "hA")
    assert not host_cooling(view(blacklisted=("hB",)), "hA")
    assert not host_cooling(None, "hA")
