"""A 4-worker FSDP2 job under elastic.ShardedState, with real processes and a real rendezvous
server: workers killed mid-backward, joining, leaving gracefully, killed two at a time."""

import os
import re
import signal

from tests.waiting import wait_until
import pytest

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane


def worlds(job, workers):
    """Every 'world' event of ``workers``, in time order."""
    evs = [e for w in workers for e in job.events(w) if e["ev"] == "world"]
    return sorted(evs, key=lambda e: e["t"])


def commit_digests(job, workers):
    """commit number -> the set of digests recorded for it (one when all agree)."""
    out = {}
    for w in workers:
        for e in job.events(w):
            if e["ev"] == "commit":
                out.setdefault(e["commit"], set()).add(e["digest"])
    return out


def wait_world(job, workers, size, after_version=0, timeout=90):
    def found():
        ws = [e for e in worlds(job, workers) if e["size"] == size and e["v"] > after_version]
        return ws[-1] if ws else None
    wait_until(lambda: found() is not None, timeout, f"a world of {size} after version {after_version}")
    return found()


def rank_of(job, worker, version):
    return next(e["rank"] for e in job.events(worker) if e["ev"] == "world" and e["v"] == version)


def assert_resumed_bitwise(job, workers, world, at_least):
    """The new world's gathered full state is bitwise the state of the commit it resumed from,
    that commit is no older than ``at_least``, and every rank's buddy copy of the layout the world
    committed again is bitwise the previous rank's own copy."""
    assert world["copies"] is not False, world
    digests = commit_digests(job, workers)
    assert world["commit"] >= at_least, (world, at_least)
    assert digests.get(world["commit"]) == {world["digest"]}, (world, digests.get(world["commit"]))


def last_commit(job, workers):
    return max(commit_digests(job, workers))


def test_a_killed_worker_is_resharded_away_twice_new_ones_resharded_in_a_leaver_redoes_nothing_and_a_lost_buddy_pair_is_a_clear_error(  # noqa: E501
        sharded_job, tmp_path):
    go, go_f = os.path.join(str(tmp_path), "go-e"), os.path.join(str(tmp_path), "go-f")
    job = sharded_job(min_np=1, max_np=4, JOB_STEPS="100000", JOB_KILL="b:3,d:0:3", JOB_KILL_SIZE="4")
    first = ["a", "b", "c", "d"]
    for w in first:
        job.start(w)
    # imports while the others train; each joins when the test says so
    job.start("e", JOB_GO_FILE=go)
    job.start("f", JOB_GO_FILE=go_f)
    w4 = wait_world(job, first, 4)
    # b kills itself inside backward (step 3 or later, in the world of 4): the three others
    # reshard its shards from its buddy
    w3 = wait_world(job, first, 3, after_version=w4["v"])
    # the commit at step 2 or later (digested by b too: it may have been taken before the others joined)
    assert_resumed_bitwise(job, first, w3, at_least=0)
    # d kills itself inside the first backward of the world of 3, before any commit of it: the
    # two others reshard again, from the copies (own and buddy) the reshard to 3 ranks took
    w2 = wait_world(job, ["a", "c"], 2, after_version=w3["v"])
    assert w2["commit"] == w3["commit"], (w2, w3)
    assert_resumed_bitwise(job, first, w2, at_least=w3["commit"])
    survivors = ["a", "c"]
    job.wait_step(w2["step"] + 2, survivors)
    # a new worker joins: 2 -> 3 at a commit, nothing rolled back
    with open(go, "w"):
        pass
    grown = wait_world(job, survivors + ["e"], 3, after_version=w2["v"])
    assert_resumed_bitwise(job, survivors, grown, at_least=last_commit(job, survivors) - 1)
    job.wait_step(grown["step"] + 2, survivors + ["e"])
    # c is told to go (SIGTERM): it leaves at the next commit, the others keep everything
    job.kill("c", signal.SIGTERM)
    rest = ["a", "e"]
    shrunk = wait_world(job, rest, 2, after_version=grown["v"])
    steps_before = [e["step"] for e in job.events("a") if e["ev"] == "step" and e["v"] == grown["v"]]
    assert shrunk["step"] == max(steps_before), "a graceful leave redid steps"
    assert_resumed_bitwise(job, ["a", "c", "e"], shrunk, at_least=last_commit(job, rest))
    assert job.wait(["c"], timeout=60) == {"c": 0}, job.log("c")
    job.wait_step(shrunk["step"] + 2, rest)
    with open(go_f, "w"):
        pass
    rest = ["a", "e", "f"]
    last = wait_world(job, rest, 3, after_version=shrunk["v"])
    assert_resumed_bitwise(job, ["a", "e"], last, at_least=last_commit(job, ["a", "e"]) - 1)
    # the layouts differ in every world (4, 3, 2, 3, 2, 3 ranks of a width 10 and a vocabulary 37);
    # with min_np=1, a loaded machine may first form a world of a alone, which holds everything
    held = [(e["size"], e["memory"]) for e in job.events("a") if e["ev"] == "world"]
    assert len([n for n, _ in held if n > 1]) >= 6, held
    assert all(m["live"] < m["full"] if n > 1 else m["live"] == m["full"] for n, m in held), held
    # after a shrink a buddy is sent only the rows it does not hold in its copies of the commit
    # resumed from: fewer bytes than whole copies (0.11-0.75 of them when one of four dies and
    # the others keep their order, by which one; 0.22-0.64 when one of three dies)
    at = [e for e in worlds(job, first) if e["v"] in (w3["v"], w2["v"])]
    assert len(at) == 3 + 2, at
    assert sum(e["buddy_bytes"] for e in at) < sum(e["memory"]["own"] for e in at), at
    # ranks 0 and 1 are buddies (1 holds 0's copy): 0's shards are gone with both, and there are
    # no durable commits: the survivor says so and stops
    job.wait_step(last["step"] + 2, rest)
    by_rank = {rank_of(job, w, last["v"]): w for w in rest}
    for r in (0, 1):
        job.kill(by_rank[r])
    codes = job.wait([by_rank[2]], timeout=60)
    assert codes[by_rank[2]] != 0
    log = job.log(by_rank[2])
    assert "CommitLostError" in log and "rank(s) [0]" in log and "no durable commit" in log, log


def test_non_buddies_lose_nothing_and_a_buddy_pair_is_restored_from_durable_commits_in_any_size(sharded_job,
                                                                                                 tmp_path):
    ckpt = os.path.join(str(tmp_path), "ckpt")
    job = sharded_job(min_np=1, max_np=4, JOB_STEPS="1000", JOB_WIDE="1", JOB_CHECKPOINT=ckpt,
                      JOB_DURABLE_EVERY="3")
    first = ["a", "b", "c", "d"]
    for w in first:
        job.start(w)
    go = os.path.join(str(tmp_path), "go-e")
    job.start("e", JOB_GO_FILE=go)   # imports while the others train; joins when the test says so
    w4 = wait_world(job, first, 4)
    job.wait_step(w4["step"] + 5, first)
    # per rank, the model and optimizer shards held, live plus the buddy copy, are at most 2.2/N
    # of the full state at N = 4 (the own committed copy is another 1/N: measured, not bounded)
    held = [e["memory"] for w in first for e in job.events(w)
            if e["ev"] == "commit" and e["commit"] >= 1 and e["size"] == 4]
    assert len(held) >= 4
    for m in held:
        assert m["live"] + m["buddy"] <= 2.2 / 4 * m["full"], m
        assert m["own"] <= 1.1 / 4 * m["full"], m
    by_rank = {rank_of(job, w, w4["v"]): w for w in first}
    before = last_commit(job, first) - 1
    # ranks 0 and 2 are not each other's buddies (1 holds 0's copy, 3 holds 2's): from memory
    for r in (0, 2):
        job.kill(by_rank[r])
    survivors = [by_rank[1], by_rank[3]]
    w2 = wait_world(job, survivors, 2, after_version=w4["v"])
    assert_resumed_bitwise(job, survivors, w2, at_least=before)
    assert "restoring the durable commit" not in job.log(survivors[0])
    # a newcomer: 2 -> 3, resharded from the survivors' layout
    with open(go, "w"):
        pass
    everyone = survivors + ["e"]
    grown = wait_world(job, everyone, 3, after_version=w2["v"])
    assert_resumed_bitwise(job, survivors, grown, at_least=w2["commit"])
    wait_until(lambda: last_commit(job, everyone) >= grown["commit"] + 4, 90, "four more commits")
    by_rank = {rank_of(job, w, grown["v"]): w for w in everyone}
    # ranks 1 and 2 are buddies (2 holds 1's copy): 1's shards are gone with both, the newest
    # durable commit (every third, written by three ranks) is read into the survivor
    for r in (1, 2):
        job.kill(by_rank[r])
    # the workers of a restart from disk (below) import meanwhile, and start when told
    restarted = sharded_job(job_id="restarted", min_np=2, max_np=2, JOB_STEPS="1000", JOB_WIDE="1",
                            JOB_CHECKPOINT=ckpt, JOB_DURABLE_EVERY="3")
    go_again = os.path.join(str(tmp_path), "go-restarted")
    again = ["x", "y"]
    for w in again:
        restarted.start(w, JOB_GO_FILE=go_again)
    rest = [by_rank[0]]
    w1 = wait_world(job, rest, 1, after_version=grown["v"])
    assert w1["commit"] % 3 == 0 and w1["commit"] > grown["commit"]
    assert_resumed_bitwise(job, everyone, w1, at_least=0)
    assert f"restoring the durable commit {w1['commit']}" in job.log(rest[0])
    job.wait_step(w1["step"] + 1, rest)
    for w in rest:
        job.kill(w)
    # the files are torch.distributed.checkpoint's: dcp.load reads them in a plain process, into
    # full tensors, and they hold what elastic-ring's own reader (no pickle) reads
    import torch
    import torch.distributed.checkpoint as dcp
    from elastic.sharded import checkpoint as sharded_checkpoint
    disk = sharded_checkpoint.read_latest(ckpt)
    assert disk is not None and disk.size in (1, 3)
    sd = {sharded_checkpoint.dcp_key(key): torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]))
          for key, shape, dtype in disk.table}
    dcp.load(sd, checkpoint_id=disk.path, no_dist=True)
    for key, shape, dtype in disk.table:
        ours = disk.rows(key, shape, getattr(torch, dtype.split(".")[-1]), 0, shape[0])
        assert torch.equal(ours.view(torch.uint8), sd[sharded_checkpoint.dcp_key(key)].view(torch.uint8)), key
    assert any(k.startswith("optim.state.") for k in sd) and any(k.startswith("model.") for k in sd)
    # a job started again from nothing (a new job, two workers) resumes from the newest durable
    # commit, resharded onto its size
    with open(go_again, "w"):
        pass
    w2 = wait_world(restarted, again, 2)
    assert w2["commit"] == disk.step
    assert_resumed_bitwise(job, everyone, w2, at_least=disk.step)


def test_a_relaunch_resumes_from_the_older_sharded_commit_past_a_newest_one_that_does_not_fit_and_a_decode_bomb(
        sharded_job, tmp_path):
    from elastic.sharded import checkpoint as sharded_checkpoint
    from elastic.state import checkpoint
    from tests.elastic.test_checkpoint import decode_bomb, write_raw
    ckpt = str(tmp_path / "ckpt")
    first = sharded_job(job_id="first", min_np=2, max_np=2, JOB_STEPS="8", JOB_CHECKPOINT=ckpt)
    for w in ("a", "b"):
        first.start(w)
    assert first.wait(["a", "b"]) == {"a": 0, "b": 0}, first.log("a") + first.log("b")
    (newest_step, newest), (older_step, older) = sharded_checkpoint.complete(ckpt)
    # The newest commit's index, rewritten checksum-valid with a table whose first tensor has a
    # row more than the model's (a stale run's model), and a newer commit still whose index would
    # decode into a memory bomb.
    index = os.path.join(newest, checkpoint.file_name(newest_step))
    step, value = checkpoint.read_file(index)
    key, shape, _ = value["replicated"]["table"][0]
    value["replicated"]["table"][0][1] = [shape[0] + 1, *shape[1:]]
    checkpoint.write(newest, step, value)
    bomb = os.path.join(ckpt, sharded_checkpoint.dir_name(newest_step + 1))
    os.makedirs(bomb, mode=0o700)
    write_raw(os.path.join(bomb, checkpoint.file_name(newest_step + 1)), newest_step + 1, decode_bomb())

    again = sharded_job(job_id="again", min_np=2, max_np=2, JOB_STEPS="12", JOB_CHECKPOINT=ckpt)
    for w in ("c", "d"):
        again.start(w)
    assert again.wait(["c", "d"]) == {"c": 0, "d": 0}, again.log("c") + again.log("d")
    first_world = worlds(again, ["c", "d"])[0]
    assert first_world["commit"] == older_step, "resumed from the commit before the newest"
    assert commit_digests(first, ["a", "b"])[older_step] == {first_world["digest"]}, "bitwise that commit's state"
    assert {e["digest"] for e in worlds(again, ["c", "d"]) if e["v"] == first_world["v"]} == {first_world["digest"]}
    logs = again.log("c") + again.log("d")
    for path, why in ((newest, f"'{key}'"), (bomb, "once decoded")):
        assert os.path.exists(path + ".corrupt"), f"{path} set aside (the job wrote its own commit there since)"
        said = [line for line in logs.splitlines() if "set aside" in line and path in line]
        assert len(said) == 1 and why in said[0], logs
    assert sharded_checkpoint.read_latest(ckpt).step > newest_step, "and the relaunched job committed on"


@pytest.mark.parametrize("mode", ["claim", "claim-now", "buffer", "bytes"])
def test_a_hostile_member_cannot_take_over_or_end_a_reshard_it_is_evicted_and_the_others_go_on(
        sharded_job, server, mode):
    # Three members train together; a fourth joins; at that reshard one member turns hostile: it
    # claims a one-rank commit at step 10^9 of the world it was in with the others, or (as the
    # reshard's root) sends the replicated state with a buffer of the wrong shape, or sends more
    # bytes than planned in a shift of the rows. Which member does is decided as the job runs
    # (the first that can: the root is whoever holds the lowest own copy).
    job = sharded_job(min_np=3, max_np=4, JOB_STEPS="40", JOB_STEP_SLEEP="0.05", JOB_EVIL=f"any:{mode}")
    members = ["a", "b", "c"]
    for w in members:
        job.start(w)
    first = wait_world(job, members, 3)
    job.wait_step(4, members)
    job.start("n")
    wait_until(lambda: [w for w in members if any(e["ev"] == "evil" for e in job.events(w))], 90,
               "a member to turn hostile")
    evil = [w for w in members if any(e["ev"] == "evil" for e in job.events(w))]
    assert len(evil) == 1, evil
    evil = evil[0]
    honest = [w for w in members if w != evil] + ["n"]
    assert job.wait(honest, timeout=180) == {w: 0 for w in honest}, "".join(job.log(w) for w in honest)
    # The honest workers blamed it (BadPeerError, reported), the rendezvous evicted it, and they
    # resumed without it: the last world is the three of them, and they end with the same state.
    # More bytes than planned reach one receiver only: a dispute over their link, nobody else can
    # tell which is wrong, so both were evicted and the honest receiver joined again.
    last = worlds(job, honest)[-1]
    assert last["size"] == 3 and last["v"] > first["v"] + 1
    assert all(e["v"] < last["v"] for e in job.events(evil) if e["ev"] == "world")
    assert job.procs[evil].poll() is None, "it never left: only the eviction removed it"
    assert re.search(rf"worker {evil} dropped: .*evicted", server.log()), server.log()
    if mode == "bytes":
        assert re.search(rf"worker {evil} dropped: .*a dispute nobody else can settle, both evicted", server.log())
    logs = "".join(job.log(w) for w in honest)
    said = {"claim": "alone claims commit 1000000000", "claim-now": "alone claims commit 1000000000",
            "buffer": "buffer 'scale'", "bytes": "bytes every rank planned for this shift"}[mode]
    assert said in logs, logs
    assert "Traceback" not in logs, logs
    done = {w: next(e for e in job.events(w) if e["ev"] == "done") for w in honest}
    assert len({d["step"] for d in done.values()}) == 1
    digests = commit_digests(job, honest)
    assert all(len(d) == 1 for d in digests.values()), "every commit is bitwise the same on every honest rank"
