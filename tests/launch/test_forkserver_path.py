"""elastic-run --preload imports from where the worker command itself would: the script's own
directory for `python SCRIPT`, the working directory for `python -m MODULE`. A module planted in the
launcher's working directory (a shared project directory another user can write) never runs for a
script that lives elsewhere (real elastic-run, real planted modules that leave a mark if imported)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from elastic.launch.forkserver import forkable, main_path

from .launch_helpers import WORKER

ELASTIC_RUN = os.path.join(os.path.dirname(sys.executable), "elastic-run")   # as a user starts it
FORKED_FROM = r"workers are forked from its process \(pid (\d+)\)"


def plant(directory, name: str, mark) -> None:
    """A module ``name`` in ``directory`` that, once imported, writes its process's pid to ``mark``."""
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.py").write_text(
        f"import os\nwith open({str(mark)!r}, 'w') as f:\n    f.write(str(os.getpid()))\n")


# ---------------------------------------------------------------------------------------------- pure
@pytest.mark.parametrize("command, cwd", [
    (["python", "{code}/train.py"], "{elsewhere}"),
    (["python", "code/train.py"], "{root}"),                # relative to the working directory
    (["python", "link.py"], "{root}"),                      # a link to code/train.py: Python follows it
    (["python", "-u", "{code}/train.py"], "{code}"),
    (["python", "-m", "train"], "{code}"),
])
def test_main_path_is_what_the_interpreter_puts_first_on_sys_path(tmp_path, command, cwd):
    root = os.path.realpath(tmp_path)
    dirs = {"root": root, "code": os.path.join(root, "code"), "elsewhere": os.path.join(root, "elsewhere")}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    with open(os.path.join(dirs["code"], "train.py"), "w") as f:
        f.write("import sys\nprint(sys.path[0])\n")
    os.symlink(os.path.join(dirs["code"], "train.py"), os.path.join(root, "link.py"))
    command = [sys.executable if c == "python" else c.format(**dirs) for c in command]
    cwd = cwd.format(**dirs)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    python = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert main_path(forkable(command), cwd) == python.stdout.strip()


# ---------------------------------------------------------------------------------------------- real launcher
@pytest.mark.slow
def test_a_module_planted_in_the_launchers_directory_is_not_preloaded_for_a_script_elsewhere(launch, tmp_path):
    shared = tmp_path / "shared"   # the launcher's working directory; tests/launch/worker.py lives elsewhere
    mark = tmp_path / "planted-ran"
    plant(shared, "numpy", mark)
    p = launch("--np", "1", "--host", "hA", "--preload", "numpy", launcher=[ELASTIC_RUN], cwd=str(shared),
               LW_STEPS="5")
    code = p.wait(60)
    assert not mark.exists(), f"the numpy.py planted in the launcher's directory ran in pid {mark.read_text()}"
    assert code == 0, p.text()
    p.wait_for(FORKED_FROM, 1)   # the worker was forked from a server that preloaded the real numpy
    # A module that is only there is not found at all, as `python /abs/train.py` would not find it.
    plant(shared, "only_here", mark)
    q = launch("--np", "1", "--host", "hA", "--preload", "only_here", launcher=[ELASTIC_RUN], cwd=str(shared))
    assert q.wait(60) == 1, q.text()
    assert q.stderr[-1] == ("elastic-run: error: --preload: cannot import only_here: ModuleNotFoundError: "
                            "No module named 'only_here'"), q.text()
    assert not mark.exists()


@pytest.mark.slow
def test_a_module_beside_the_script_is_preloaded_by_the_fork_server(launch, tmp_path):
    code, elsewhere = tmp_path / "code", tmp_path / "elsewhere"
    code.mkdir()
    elsewhere.mkdir()
    shutil.copy(WORKER, code / "train.py")
    mark = tmp_path / "beside-ran"
    plant(code, "beside", mark)
    p = launch("--np", "1", "--host", "hA", "--preload", "beside", launcher=[ELASTIC_RUN], cwd=str(elsewhere),
               command=[sys.executable, str(code / "train.py")], LW_STEPS="5")
    server = int(p.wait_for(FORKED_FROM, 60).group(1))
    assert p.wait(60) == 0, p.text()
    assert mark.read_text() == str(server)   # imported once, by the server, as `python code/train.py` would


@pytest.mark.slow
def test_with_dash_m_a_module_in_the_working_directory_is_preloaded_as_python_dash_m_would(launch, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(WORKER, work / "train.py")
    mark = tmp_path / "beside-ran"
    plant(work, "beside", mark)
    p = launch("--np", "1", "--host", "hA", "--preload", "beside", launcher=[ELASTIC_RUN], cwd=str(work),
               command=[sys.executable, "-m", "train"], LW_STEPS="5")
    server = int(p.wait_for(FORKED_FROM, 60).group(1))
    assert p.wait(60) == 0, p.text()
    assert mark.read_text() == str(server)
