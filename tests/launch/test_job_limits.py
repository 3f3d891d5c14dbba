"""A job's limits are fixed by the launcher whose worker creates it; a later launcher that asks for
other --min-np/--max-np is refused with one line naming both values, and one that asks for none
takes the job's (docs: Many hosts)."""
from __future__ import annotations


import pytest


pytestmark = pytest.mark.slow


def _first(launch):
    first = launch("--np", "1", "--host", "hA", LW_STEPS="100000")
    port = first.wait_for(r"rendezvous server for job default on 127\.0\.0\.1:(\d+)", 60).group(1)
    token = first.wait_for(r"its token is in (\S+) ", 60).group(1)
    first.wait_training(1, 90)
    return first, ["--rendezvous", f"127.0.0.1:{port}", "--job-id", "default", "--token-file", token]


def test_a_later_launcher_asking_for_another_min_np_is_refused_naming_both_values(launch):
    first, join = _first(launch)
    later = launch("--np", "1", "--min-np", "2", "--host", "hB", *join)
    code = later.wait(90)
    assert code != 0, later.text()
    line = later.wait_for(r"^elastic-run: error: job default runs with --min-np 1 --max-np \d+; this launcher asks "
                          r"for 2 and \d+", 5)
    assert code == 2 or code == 1, later.text()
    first.finish()
    assert first.wait(60) == 0, first.text()


def test_a_later_launcher_without_limits_takes_the_job_s(launch):
    first, join = _first(launch)
    later = launch("--np", "1", "--host", "hB", *join, LW_STEPS="100000",
                   LW_FINISH_AT=first.finish_file)   # the same job: one length, one end
    later.wait_for(r"world \d+: 2 worker\(s\)", 90)
    first.finish()
    assert first.wait(90) == 0, first.text()
    assert later.wait(60) == 0, later.text()
