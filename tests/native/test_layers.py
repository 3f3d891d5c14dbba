"""The native core's layers, as native/README.md lists them, checked on its #include lines.

Lowest first: base/ (shared vocabulary and settings), transport/ (sockets, handshake,
listener, links), the algorithms in native/src itself, binding.cc on top. A file may include
its own layer and the ones below. The concrete ends (transport/tcp_links.h,
transport/shm_links.h) are included only where links are set up (transport/link_setup.cc)
and by their own sources. Every project include is written from native/src."""

from __future__ import annotations

import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "native" / "src"
LAYERS = ("base", "transport", "algorithms", "binding")
CONCRETE_ENDS = {"transport/tcp_links.h", "transport/shm_links.h"}
SETS_UP_LINKS = {"transport/link_setup.cc"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def layer_of(path: str) -> int:
    """The layer of a file, by its path under native/src."""
    if path == "binding.cc":
        return LAYERS.index("binding")
    folder = path.split("/")[0] if "/" in path else ""
    if folder in ("base", "transport"):
        return LAYERS.index(folder)
    if folder == "":
        return LAYERS.index("algorithms")
    raise ValueError(f"native/src/{path} is in no layer: put it in base/, transport/ or native/src itself")


def violations(includes: dict, exists) -> list:
    """What breaks the rules, one line each, for {file: [included path, ...]} (paths under
    native/src); `exists(path)` says whether an included path is a file there."""
    found = []
    for file, included in sorted(includes.items()):
        for inc in included:
            if not exists(inc):
                found.append(f"{file} includes \"{inc}\", which is no file under native/src "
                             f"(write project includes from native/src, e.g. \"transport/links.h\")")
                continue
            if layer_of(inc) > layer_of(file):
                found.append(f"{file} includes {inc}: {LAYERS[layer_of(file)]} may not include "
                             f"{LAYERS[layer_of(inc)]}, a layer above it")
            own_source = inc.rsplit(".", 1)[0] == file.rsplit(".", 1)[0]
            if inc in CONCRETE_ENDS and file not in SETS_UP_LINKS and not own_source:
                found.append(f"{file} includes {inc}: only {', '.join(sorted(SETS_UP_LINKS))} knows "
                             f"the concrete ends; use transport/links.h")
    return found


def includes_of_tree(src: pathlib.Path) -> dict:
    return {str(p.relative_to(src)): INCLUDE.findall(p.read_text())
            for p in sorted(src.rglob("*")) if p.suffix in (".h", ".cc")}


def test_the_core_keeps_its_layers():
    includes = includes_of_tree(SRC)
    assert "transport/links.cc" in includes and "communicator.cc" in includes  # the tree was found
    assert violations(includes, lambda p: (SRC / p).is_file()) == []


def test_every_source_file_is_in_a_layer():
    for path in includes_of_tree(SRC):
        layer_of(path)


# The checker itself, on made-up trees: which includes it lets through and which it names.
FAKE_FILES = {"base/common.h", "base/config.h", "transport/io.h", "transport/links.h",
              "transport/tcp_links.h", "transport/shm_links.h", "plans.h", "communicator.h"}


@pytest.mark.parametrize("file,inc,complaint", [
    ("plans.h", "transport/links.h", None),                  # an algorithm uses the links interface
    ("transport/links.h", "base/common.h", None),             # the transport uses the vocabulary
    ("transport/links.cc", "transport/io.h", None),           # within a layer
    ("binding.cc", "communicator.h", None),                   # the binding sits on top
    ("transport/link_setup.cc", "transport/tcp_links.h", None),   # where links are set up
    ("transport/tcp_links.cc", "transport/tcp_links.h", None),    # a concrete end's own source
    ("transport/links.cc", "communicator.h", "transport may not include algorithms"),
    ("base/config.cc", "transport/io.h", "base may not include transport"),
    ("plans.cc", "binding.cc", "algorithms may not include binding"),
    ("communicator.cc", "transport/shm_links.h", "only transport/link_setup.cc knows the concrete ends"),
    ("transport/links.cc", "transport/tcp_links.h", "only transport/link_setup.cc knows the concrete ends"),
    ("transport/connect.cc", "io.h", "no file under native/src"),   # relative to its folder
])
def test_the_checker_names_upward_and_concrete_includes(file, inc, complaint):
    exists = {*FAKE_FILES, "binding.cc"}.__contains__
    found = violations({file: [inc]}, exists)
    if complaint is None:
        assert found == []
    else:
        assert len(found) == 1 and complaint in found[0] and file in found[0], found


def test_the_checker_refuses_a_file_outside_the_layers():
    with pytest.raises(ValueError, match="in no layer"):
        layer_of("util/strings.h")


def test_the_include_pattern_reads_quoted_includes_only():
    text = '#include "transport/links.h"\n#include <vector>\n  #  include "base/common.h"\n// #include "x.h" is a comment\n'
    assert INCLUDE.findall(text) == ["transport/links.h", "base/common.h"]
