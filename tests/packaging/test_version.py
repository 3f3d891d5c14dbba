"""One version: pyproject.toml holds it; the packages and both commands report it from the metadata."""

from __future__ import annotations

import pytest
import importlib.metadata
import os
import pathlib
import subprocess
import sys
import tomllib

import elastic
import rendezvous

REPO = pathlib.Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
BIN = os.path.dirname(sys.executable)


def output(*args: str) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_packages_report_the_version_in_pyproject():
    # A mismatch here means the install is older than the checkout: `pip install -e .` again.
    assert importlib.metadata.version("elastic-ring") == VERSION
    assert elastic.__version__ == VERSION
    assert rendezvous.__version__ == VERSION


@pytest.mark.slow
def test_elastic_run_version_flag_prints_it_and_exits_0():
    assert output(os.path.join(BIN, "elastic-run"), "--version") == f"elastic-run {VERSION}\n"
    assert output(sys.executable, "-m", "elastic.launch", "--version") == f"elastic-run {VERSION}\n"


@pytest.mark.slow
def test_elastic_rendezvous_version_flag_prints_it_and_exits_0():
    assert output(os.path.join(BIN, "elastic-rendezvous"), "--version") == f"elastic-rendezvous {VERSION}\n"
    assert output(sys.executable, "-m", "rendezvous", "--version") == f"elastic-rendezvous {VERSION}\n"


@pytest.mark.slow
def test_version_flag_wins_over_a_worker_command():
    # `elastic-run --version -- python train.py` starts nothing: it only prints the version.
    assert output(os.path.join(BIN, "elastic-run"), "--version", "--", "false") == f"elastic-run {VERSION}\n"


def test_a_source_tree_that_was_never_installed_says_its_version_is_unknown():
    # -S: no site-packages, so no installed metadata; the checkout itself is the only path.
    probe = f"import sys; sys.path.insert(0, {str(REPO)!r}); import rendezvous; print(rendezvous.__version__)"
    assert output(sys.executable, "-S", "-c", probe) == "0+unknown\n"
