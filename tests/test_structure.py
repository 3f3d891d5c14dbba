"""How the packages hang together, checked from their source: no import circle in `elastic/` or
`rendezvous/` (imports inside functions and under TYPE_CHECKING count too: a lazy import is still a
dependency), no server helper that reaches for the server, a worker that loads none of the
server's code, and no source file longer than a reader can hold (700 lines)."""
from __future__ import annotations

import ast
import os
from typing import Iterator

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("elastic", "rendezvous")
MAX_LINES = 700


def modules(package: str) -> dict[str, str]:
    """Every module of `package` (dotted name -> path), subpackages included."""
    out = {}
    root = os.path.join(REPO, package)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), REPO)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(dirpath, f)
    return out


ALL = {name: path for p in PACKAGES for name, path in modules(p).items()}


def _tree(module: str) -> ast.Module:
    with open(ALL[module]) as f:
        return ast.parse(f.read(), ALL[module])


def top_level_names(module: str) -> set[str]:
    """The names `module` binds at its top level (what `from module import name` can find)."""
    names = set()
    for node in _tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def imported(module: str, path: str) -> Iterator[str]:
    """The modules of this repository that `module` imports, wherever the import statement is."""
    tree = _tree(module)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ALL:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:   # `from pkg import mod` imports the module pkg.mod
                if f"{target}.{alias.name}" in ALL:
                    yield f"{target}.{alias.name}"
                elif target in ALL and alias.name in top_level_names(target):
                    yield target
                # else: a compiled module (elastic.ring._native), not a source of circles


GRAPH = {m: sorted(set(imported(m, p)) - {m}) for m, p in ALL.items()}


def closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += GRAPH[m]
    return seen


def circles(package: str, graph: dict[str, list[str]] = GRAPH) -> list[list[str]]:
    """The strongly connected groups of more than one module within `package` (Tarjan)."""
    inside = {m for m in graph if m == package or m.startswith(package + ".")}
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(m):
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in graph[m]:
            if n not in inside:
                continue
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            group = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                group.append(n)
                if n == m:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for m in sorted(inside):
        if m not in index:
            visit(m)
    return out


def test_the_import_graph_sees_lazy_imports():
    # The check must not be blind to what it is for: cli.py imports the server inside a function.
    assert "rendezvous.server.service" in GRAPH["rendezvous.cli"]
    assert "rendezvous.common.channel" in GRAPH["rendezvous.server.store"]   # inside EtcdStore.__init__


def test_a_circle_through_several_modules_is_found_and_only_within_the_package():
    graph = {"p.a": ["p.b"], "p.b": ["p.c", "q.x"], "p.c": ["p.a"], "p.d": ["p.a"], "q.x": ["p.d"]}
    assert circles("p", graph) == [["p.a", "p.b", "p.c"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle_within_the_package(package):
    assert circles(package) == []


# Only the command line starts the server; every helper of it is given what it needs instead.
SERVER_USERS = {"rendezvous.cli"}


def test_no_server_helper_imports_the_server():
    users = {m for m, deps in GRAPH.items() if "rendezvous.server.service" in deps}
    assert users <= SERVER_USERS, sorted(users - SERVER_USERS)


# What of the rendezvous package a worker may load: its client and what both sides share.
WORKER_SIDE = {"rendezvous", "rendezvous.wire._proto", "rendezvous.wire._proto.rendezvous_pb2",
               "rendezvous.wire._proto.rendezvous_pb2_grpc", "rendezvous.common.channel", "rendezvous.common.files",
               "rendezvous.wire.membership", "rendezvous.client.watch_events", "rendezvous.wire.messages",
               "rendezvous.client.worker_client"}
CLIENT_ONLY = {"rendezvous.client.worker_client", "rendezvous.client.status_client", "rendezvous.client.watch_events"}


def test_a_worker_loads_none_of_the_servers_code():
    # What `import elastic` brings in: the training runtime and the worker's client.
    loaded = {m for m in closure("elastic") if m.startswith("rendezvous")}
    assert "rendezvous.client.worker_client" in loaded
    assert loaded <= WORKER_SIDE, sorted(loaded - WORKER_SIDE)


def test_the_server_loads_none_of_the_clients():
    loaded = closure("rendezvous.server.service")
    assert not loaded & CLIENT_ONLY, sorted(loaded & CLIENT_ONLY)


def test_the_rendezvous_service_imports_nothing_of_the_training_runtime():
    assert not any(n.startswith("elastic") for m in modules("rendezvous") for n in GRAPH[m])


# The native core's objects are the Communicator's alone: every other layer uses its public
# methods (Gloo's algorithms see only the transport interface), so what the core is given is
# checked in one place.
NATIVE_OWNER = "elastic.ring.communicator"


def _native_attribute_uses(module: str) -> list[int]:
    return sorted(n.lineno for n in ast.walk(_tree(module)) if isinstance(n, ast.Attribute) and n.attr == "_native")


def test_the_check_for_native_access_sees_it():
    assert _native_attribute_uses(NATIVE_OWNER)   # self._native, where it belongs


def test_no_module_but_the_communicator_reaches_into_the_native_core():
    users = {m: lines for m in ALL if m != NATIVE_OWNER and (lines := _native_attribute_uses(m))}
    assert users == {}


def _lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def _source_files() -> list[str]:
    return sorted(os.path.relpath(p, REPO) for p in ALL.values()
                  if os.sep + "_proto" + os.sep not in p)   # generated by grpcio-tools


def test_every_source_file_is_at_most_700_lines():
    long = {f: n for f in _source_files() if (n := _lines(os.path.join(REPO, f))) > MAX_LINES}
    assert long == {}


def redefined(source: str) -> list[str]:
    """Functions and classes a module (or a class) defines twice at one level: the later one
    silently replaces the earlier, so a test defined twice never runs in its first form."""
    found = []
    for scope in [ast.parse(source)] + [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]:
        seen: set = set()
        for node in scope.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name in seen and not any(_is_property_setter(d) for d in node.decorator_list):
                found.append(f"{node.name} (line {node.lineno})")
            seen.add(node.name)
    return found


def _is_property_setter(decorator: ast.expr) -> bool:
    return isinstance(decorator, ast.Attribute) and decorator.attr in ("setter", "deleter")


@pytest.mark.parametrize("source, found", [
    ("def a(): pass\ndef b(): pass\n", []),
    ("def test_x(): pass\ndef test_x(): assert 0\n", ["test_x (line 2)"]),
    ("class C:\n    def f(self): pass\n    def f(self): pass\n", ["f (line 3)"]),
    ("class C:\n    @property\n    def v(self): pass\n    @v.setter\n    def v(self, x): pass\n", []),
])
def test_the_check_for_redefinitions_sees_them(source, found):
    assert redefined(source) == found


def test_no_module_of_the_project_or_its_tests_defines_a_name_twice():
    roots = PACKAGES + ("tests", "bench", "examples")
    paths = sorted(os.path.join(d, f) for root in roots for d, _, files in os.walk(os.path.join(REPO, root))
                   for f in files if f.endswith(".py") and os.sep + "_proto" + os.sep not in os.path.join(d, f))
    twice = {}
    for path in paths:
        with open(path) as f:
            if found := redefined(f.read()):
                twice[os.path.relpath(path, REPO)] = found
    assert twice == {}
