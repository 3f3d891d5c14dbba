"""Fresh virtual environments for the installed-package tests, and the commands run in them.

A fresh venv gets no test extra. Its torch is the one this test run already has: the installed
distribution and its runtime requirements are linked into one directory that the new venv's
.pth file puts on sys.path, so pip sees `torch>=2.13` satisfied and installs only elastic-ring's
other requirements (through the ordinary registry, from pip's cache where it can). Copying torch
would write about a gigabyte per venv; `--system-site-packages` would give the base interpreter's
packages, not this venv's.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import subprocess
import sys
from typing import Dict, List, Sequence

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = pathlib.Path(__file__).resolve().parents[2]


def requirement_closure(name: str) -> List[importlib.metadata.Distribution]:
    """The installed distribution ``name`` and every distribution it needs at run time, transitively
    (requirements whose markers hold here; no extras)."""
    found: Dict[str, importlib.metadata.Distribution] = {}
    todo = [name]
    while todo:
        key = canonicalize_name(todo.pop())
        if key in found:
            continue
        dist = importlib.metadata.distribution(key)
        found[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def link_distributions(dists: Sequence[importlib.metadata.Distribution], into: pathlib.Path) -> None:
    """Symlink each distribution's top-level packages, modules and .dist-info directory into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    for dist in dists:
        root = pathlib.Path(dist.locate_file(""))
        tops = {pathlib.PurePosixPath(f).parts[0] for f in dist.files or []}
        for top in sorted(tops):
            # Scripts live outside site-packages (".."); a shared __pycache__ or .pth is no one's.
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            source, link = root / top, into / top
            if source.exists() and not link.exists():
                link.symlink_to(source)


def make_venv(path: pathlib.Path, shared: pathlib.Path) -> pathlib.Path:
    """A new venv at ``path`` (no pip: this run's pip installs into it) that also sees ``shared``;
    returns its python."""
    run([sys.executable, "-m", "venv", "--without-pip", str(path)], timeout=120)
    python = path / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], timeout=60)
    (pathlib.Path(site.stdout.strip()) / "_shared_torch.pth").write_text(f"{shared}\n")
    return python


def pip_install(python: pathlib.Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``pip install ARGS`` into the venv of ``python``, by this run's pip (``--python``)."""
    return run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-input", *args],
               timeout=timeout)


def user_env(venv: pathlib.Path) -> Dict[str, str]:
    """The environment of a user whose venv is activated: its bin/ first on PATH, this test run's
    venv and source tree nowhere, no PYTHON* or ELASTIC_* settings inherited from the suite."""
    own_bin = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "ELASTIC_")) and k != "VIRTUAL_ENV"}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != own_bin]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    env["VIRTUAL_ENV"] = str(venv)
    return env


def run(args: Sequence[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Runs ``args`` to completion; fails the test with its output when it exits non-zero."""
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kwargs)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {proc.returncode}\n"
                             f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc
