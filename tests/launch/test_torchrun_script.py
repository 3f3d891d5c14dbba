"""A torchrun DDP script and its elastic-ring version (examples/from_torchrun/): the docs show
the first whole and the real diff to the second, both train to the end under their own
launcher, and what a torchrun script does that cannot work here says what to do instead."""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys

import pytest
import torch

from .launch_helpers import REPO

EXAMPLES = os.path.join(REPO, "examples", "from_torchrun")
TORCHRUN_SCRIPT = os.path.join(EXAMPLES, "ddp_torchrun.py")
ELASTIC_SCRIPT = os.path.join(EXAMPLES, "ddp_elastic.py")
JOB = os.path.join(os.path.dirname(__file__), "torch_mistakes_job.py")


def _read(path: str) -> list:
    with open(path) as f:
        return f.read().splitlines()


def _readme_block(readme: str, language: str, after: str) -> str:
    """The first ```language block after the line containing ``after``."""
    start = readme.index(after)
    m = re.compile(rf"^```{language}\n(.*?)^```$", re.S | re.M).search(readme, start)
    assert m, f"no ```{language} block after {after!r} in README.md"
    return m.group(1)


@pytest.mark.parametrize("kind,page", [("ddp", "ddp.md"), ("fsdp", "fsdp.md")])
def test_the_docs_show_the_whole_torchrun_script_and_the_real_diff_to_its_elastic_version(kind, page):
    with open(os.path.join(REPO, "docs", "guides", page)) as f:
        readme = f.read()
    torchrun = _read(os.path.join(EXAMPLES, f"{kind}_torchrun.py"))
    elastic_version = _read(os.path.join(EXAMPLES, f"{kind}_elastic.py"))
    assert _readme_block(readme, "python", f"examples/from_torchrun/{kind}_torchrun.py").splitlines() == torchrun
    diff = list(difflib.unified_diff(torchrun, elastic_version, f"{kind}_torchrun.py", f"{kind}_elastic.py",
                                     lineterm=""))
    assert _readme_block(readme, "diff", f"examples/from_torchrun/{kind}_elastic.py").splitlines() == diff
    removed = sum(1 for line in diff[2:] if line.startswith("-"))
    added = sum(1 for line in diff[2:] if line.startswith("+"))
    blank = sum(1 for line in diff[2:] if line == "+")
    assert f"{removed} lines removed and {added} added ({blank} of them blank)" in readme, (removed, added, blank)


def _epochs(text: str) -> list:
    return re.findall(r"epoch (\d+): loss ([0-9.]+) over (\d+) samples, (\d+) batches per rank", text)


@pytest.mark.slow
def test_the_torchrun_script_and_its_elastic_version_both_train_to_the_end(launch, tmp_path):
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", TORCHRUN_SCRIPT,
         "--epochs", "2", "--save", str(tmp_path / "torchrun.pt")],
        cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    p = launch("--np", "2", "--host", "hA",
               command=[sys.executable, ELASTIC_SCRIPT, "--epochs", "2", "--save", str(tmp_path / "elastic.pt")])
    assert p.wait(180) == 0, p.text()
    for text in (torchrun.stdout, p.text()):
        epochs = _epochs(text)
        # The same epochs, samples and batches per rank; the losses differ only by the
        # samplers' shuffles.
        assert [(e, n, b) for e, _, n, b in epochs] == [("0", "2048", "32"), ("1", "2048", "32")], text
        assert float(epochs[1][1]) < float(epochs[0][1]) < 1.0, text
    # Saved by rank 0 after the run, then barrier and destroy_process_group on both.
    saved = [torch.load(tmp_path / name, weights_only=True) for name in ("torchrun.pt", "elastic.pt")]
    assert saved[0].keys() == saved[1].keys() and all(saved[1][k].shape == v.shape for k, v in saved[0].items())
    p.wait_no_leftovers()


@pytest.mark.slow
def test_the_fsdp_torchrun_script_and_its_elastic_version_both_train_to_the_end_without_warnings(launch, tmp_path):
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(EXAMPLES, "fsdp_torchrun.py"), "--epochs", "2", "--ckpt", str(tmp_path / "dcp")],
        cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    p = launch("--np", "2", "--host", "hA", command=[sys.executable, os.path.join(EXAMPLES, "fsdp_elastic.py"),
                                                     "--epochs", "2", "--ckpt", str(tmp_path / "ck")])
    assert p.wait(240) == 0, p.text()
    for text in (torchrun.stdout, p.text()):
        epochs = _epochs(text)
        assert [(e, n, b) for e, _, n, b in epochs] == [("0", "512", "16"), ("1", "512", "16")], text
        assert float(epochs[1][1]) < float(epochs[0][1]), text
    assert "Warning" not in p.text(), p.text()
    # Each epoch's commit is durable: DCP's format, readable without elastic-ring.
    assert sorted(os.listdir(tmp_path / "ck"))
    p.wait_no_leftovers()


@pytest.mark.slow
def test_after_the_run_collectives_run_on_the_last_world_until_destroy_process_group(launch):
    p = launch("--np", "2", "--host", "hA", command=[sys.executable, JOB, "after-run"])
    assert p.wait(120) == 0, p.text()
    for rank in (0, 1):
        p.wait_for(rf"^\[hA-\d\] after the run: rank {rank} of 2 summed 3$", 1)
    destroyed = [line for line in p.stdout + p.stderr if "after destroy_process_group:" in line]
    assert len(destroyed) == 2 and all("no default group here" in line for line in destroyed), p.text()


@pytest.mark.slow
@pytest.mark.parametrize("mode, says", [
    ("rank-before-run", "installed when the @elastic.run function starts"),
    ("torch-ddp-before-run", "use elastic.DistributedDataParallel(module, ...) with the same arguments"),
    ("torch-ddp-inside-run", "use elastic.DistributedDataParallel(module, ...) with the same arguments"),
    ("init-before-run", "dist.init_process_group() cannot run here: under elastic-run the default group is"),
    ("init-inside-run", "inside @elastic.run the default group is already the elastic ring; remove the call"),
    ("sampler-before-run", "use elastic.ElasticSampler(dataset, shuffle=..., seed=...)"),
    ("dcp-inside-run", "Make commits durable with @elastic.run(checkpoint_dir=DIR, checkpoint_every=N)"),
])
def test_what_cannot_work_under_elastic_run_names_the_fix_in_the_launchers_last_line(launch, mode, says, tmp_path):
    p = launch("--np", "1", "--host", "hA", command=[sys.executable, JOB, mode, str(tmp_path / "dcp")])
    assert p.wait(120) != 0
    last = p.stderr[-1]
    assert last.startswith("elastic-run: error: worker hA-0") and says in last, p.text()
    assert "please make sure to call init_process_group" not in p.text()
    assert "expected 2 output tensors" not in p.text()
    assert "environment variable RANK expected" not in p.text()
    assert "cannot be carried" not in last
    p.wait_no_leftovers()
