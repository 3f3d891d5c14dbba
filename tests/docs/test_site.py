"""The documentation site builds with every link and API name resolved (`mkdocs build --strict`),
and its generated references match the code: every flag, every public name, every variable."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

import elastic
from elastic.ring.ops import ReduceOp

from .docs_text import REPO, reference


def _variables_the_code_reads() -> set:
    found = set()
    for package in ("elastic", "rendezvous"):
        for path in pathlib.Path(REPO, package).rglob("*.py"):
            found.update(re.findall(r"[\"'](ELASTIC_[A-Z_]*[A-Z])[\"']", path.read_text()))
    return found


def test_the_environment_reference_lists_every_variable_a_worker_reads_and_no_other():
    documented = reference().documented_variables()
    # The server's one variable is on the same page, outside the worker's table.
    assert _variables_the_code_reads() - documented == {"ELASTIC_ETCD_PASSWORD"}
    assert documented - _variables_the_code_reads() == set()


def test_the_api_reference_covers_every_public_name():
    named = {name for name, _ in reference().api_paths()}
    members = {n for n in elastic.__all__ if isinstance(getattr(elastic, n), ReduceOp)}
    assert named == set(elastic.__all__) - members and members == {"Sum", "Average", "Min", "Max"}


def test_the_metrics_reference_lists_every_metric_the_server_and_the_launcher_expose():
    from elastic.launch.host_metrics import WORKER_METRICS
    from rendezvous.server.server_metrics import ServerMetrics
    page = open(os.path.join(REPO, "docs", "reference", "metrics.md")).read()
    server = ServerMetrics(job_states=lambda: [], is_leader=lambda: True, leadership_losses=lambda: 0)
    names = {f.name for f in server.registry.collect() if f.name.startswith("elastic_")}
    names |= {name for name, _, _ in WORKER_METRICS}
    assert len(names) > 20
    assert [n for n in sorted(names) if n not in page] == []


def test_the_metrics_reference_lists_every_event():
    from rendezvous.common.event_log import EVENTS
    page = open(os.path.join(REPO, "docs", "reference", "metrics.md")).read()
    assert [e for e in sorted(EVENTS) if f"`{e}`" not in page] == []


@pytest.mark.slow
def test_the_site_builds_strict_and_its_references_match_the_code(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    site = tmp_path / "site"
    cli = (site / "reference" / "cli" / "index.html").read_text()
    ref = reference()
    for program in ("elastic-run", "elastic-rendezvous"):
        flags = ref.option_strings(program)
        assert len(flags) > 10
        assert [f for f in sorted(flags) if f not in cli] == [], program
    api = (site / "reference" / "python-api" / "index.html").read_text()
    assert [n for n, _ in ref.api_paths() if f'id="elastic.{n}"' not in api and f"elastic.{n}</code>" not in api] == []
    env_page = (site / "reference" / "environment" / "index.html").read_text()
    assert [v for v in ref.documented_variables() if v not in env_page] == []
    # The changelog page is the repository's CHANGELOG.md, included whole.
    assert "Keep a Changelog" in (site / "changelog" / "index.html").read_text()
