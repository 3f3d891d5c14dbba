"""One version: pyproject.toml holds it; the packages and both commands report it from the metadata."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import elastic
import rendezvous

REPO = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
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


def test_the_supported_versions_are_the_ones_the_suite_runs_on():
    # Supported means tested: the floors are the interpreter and the torch this suite runs with.
    project = PYPROJECT["project"]
    assert SpecifierSet(project["requires-python"]) == SpecifierSet(f">={sys.version_info[0]}.{sys.version_info[1]}")
    floor = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch")
    pinned = next(Requirement(r) for r in project["optional-dependencies"]["test"] if Requirement(r).name == "torch")
    tested = torch.__version__.split("+")[0]
    assert pinned.specifier == SpecifierSet(f"=={tested}")
    assert floor.specifier == SpecifierSet(f">={'.'.join(tested.split('.')[:2])}")
