"""How the packages hang together, checked from their source: the layers in the folders, lowest
first, and no import that goes up (imports inside functions and under TYPE_CHECKING count: a lazy
import is still a dependency; so do the imports the native module makes itself); no import circle;
no module-level mutable state in elastic/ but the one session pointer and locks; nothing
registered as a side effect of importing a module; no source file longer than a reader can hold."""
from __future__ import annotations

import ast
import os
import re
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("elastic", "rendezvous")
MAX_LINES = 700
NATIVE = "elastic.ring._native"   # compiled from native/src: its own imports are read from binding.cc

# The layers, lowest first. A module may import its own layer and the layers before it, except
# the pairs in APART. A layer is a package (and everything under it) or one module.
LAYERS = (
    "rendezvous.common",    # files, channel, event log, ports, /metrics: what both sides share
    "rendezvous.wire",      # the generated messages and the membership types both sides speak
    "rendezvous.client",    # a worker's and a watcher's clients
    "rendezvous.server",    # the service, its decision and helpers, the stores
    "rendezvous.cli",       # elastic-rendezvous: serve, status
    "elastic.ring",         # the native core's one owner, the ring's errors, the object format
    "elastic.runtime",      # the session, the current world, the pure reactions
    "elastic.state",        # committed state, its sync, durable commits, the sampler
    "elastic.torchdist",    # torch.distributed on the ring
    "elastic.sharded",      # FSDP2 state
    "elastic.run",          # elastic.run, and `import elastic` itself
    "elastic.launch",       # elastic-run
)
# Lower layers a layer must still not import: a worker loads none of the server's code, the
# server none of the clients', and the rendezvous service nothing of the training runtime.
APART = {
    "rendezvous.server": {"rendezvous.client"},
    **{layer: {"rendezvous.server", "rendezvous.cli"} for layer in LAYERS if layer.startswith("elastic")},
}
# Where the packages' own __init__ and __main__ sit.
PLACED = {"rendezvous": "rendezvous.common", "rendezvous.__main__": "rendezvous.cli", "elastic": "elastic.run"}


def modules(package: str) -> Dict[str, str]:
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


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def top_level_names(source: str) -> Set[str]:
    """The names a module binds at its top level (what `from module import name` can find)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def imports_in(source: str, module: str, is_package: bool, known: Set[str],
               names_of=lambda m: top_level_names(_read(ALL[m]))) -> Iterator[str]:
    """The modules of `known` that `source` (the module `module`) imports, wherever the import
    statement is: at the top, inside a function, under TYPE_CHECKING."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:   # `from pkg import mod` imports the module pkg.mod
                if f"{target}.{alias.name}" in known:
                    yield f"{target}.{alias.name}"
                elif target in known:
                    yield target


def native_imports(sources: Iterable[str]) -> Set[str]:
    """The Python modules the native module imports itself (nanobind's ``module_::import_``)."""
    return {m for text in sources for m in re.findall(r'module_::import_\(\s*"([\w.]+)"', text)}


def _graph() -> Dict[str, List[str]]:
    known = set(ALL) | {NATIVE}
    graph = {m: sorted(set(imports_in(_read(p), m, p.endswith("__init__.py"), known)) - {m}) for m, p in ALL.items()}
    src = os.path.join(REPO, "native", "src")
    sources = [_read(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs if f.endswith((".cc", ".h"))]
    graph[NATIVE] = sorted(native_imports(sources))
    return graph


GRAPH = _graph()


def layer_of(module: str, layers: Sequence[str] = LAYERS, placed: Dict[str, str] = PLACED) -> Optional[str]:
    if module in placed:
        return placed[module]
    found = [layer for layer in layers if module == layer or module.startswith(layer + ".")]
    return max(found, key=len) if found else None


def upward_imports(graph: Dict[str, Iterable[str]], layers: Sequence[str] = LAYERS,
                   apart: Dict[str, Set[str]] = APART, placed: Dict[str, str] = PLACED) -> List[Tuple[str, str]]:
    """Every (importer, imported) pair where the imported module is in a later layer, or in a
    layer the importer's must keep apart from, or in no layer at all."""
    order = {layer: i for i, layer in enumerate(layers)}
    bad = []
    for importer, targets in graph.items():
        mine = layer_of(importer, layers, placed)
        for target in targets:
            theirs = layer_of(target, layers, placed)
            if mine is None or theirs is None or order[theirs] > order[mine] or theirs in apart.get(mine, ()):
                bad.append((importer, target))
    return sorted(bad)


TABLE_LAYERS = ("p.low", "p.mid", "p.top")


@pytest.mark.parametrize("source, module, found", [
    ("from p.mid import x\n", "p.low.a", [("p.low.a", "p.mid")]),                          # up at the top
    ("def f():\n    from p.top import b\n", "p.mid.m", [("p.mid.m", "p.top.b")]),         # up inside a function
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.top.b\n", "p.low.a",
     [("p.low.a", "p.top.b")]),                                                           # up for typing only
    ("from p.low import a\nfrom . import m\n", "p.mid.n", []),                            # down and sideways
])
def test_the_layer_check_catches_an_upward_import_wherever_it_is(source, module, found):
    known = {"p.low.a", "p.mid", "p.mid.m", "p.mid.n", "p.top.b"}
    graph = {module: sorted(set(imports_in(source, module, False, known, names_of=lambda m: {"x"})))}
    assert upward_imports(graph, TABLE_LAYERS, {}, {}) == found


def test_the_layer_check_catches_the_native_modules_own_imports():
    binding = 'nb::object mod = nb::module_::import_("p.top.b");\n'
    graph = {"p.low._native": sorted(native_imports([binding]))}
    assert upward_imports(graph, TABLE_LAYERS, {}, {}) == [("p.low._native", "p.top.b")]


def test_the_layer_check_keeps_apart_what_must_be_and_places_every_module():
    assert upward_imports({"p.mid.x": ["p.low.a"]}, TABLE_LAYERS, {"p.mid": {"p.low"}}, {}) == [("p.mid.x", "p.low.a")]
    assert upward_imports({"q.stray": []}, TABLE_LAYERS, {}, {}) == []
    assert upward_imports({"p.low.a": ["q.stray"]}, TABLE_LAYERS, {}, {}) == [("p.low.a", "q.stray")]


def test_every_module_is_in_a_layer():
    assert [m for m in GRAPH if layer_of(m) is None] == []


def test_no_import_goes_up_a_layer():
    assert upward_imports(GRAPH) == []


def test_only_the_ring_imports_the_native_core():
    users = {m for m, deps in GRAPH.items() if NATIVE in deps}
    assert users and all(layer_of(m) == "elastic.ring" for m in users), sorted(users)


def test_the_native_core_imports_no_python_module_of_ours():
    assert GRAPH[NATIVE] == []


def test_the_import_graph_sees_lazy_imports():
    # The check must not be blind to what it is for: cli.py imports the server inside a function.
    assert "rendezvous.server.service" in GRAPH["rendezvous.cli"]
    assert "rendezvous.common.channel" in GRAPH["rendezvous.server.store"]   # inside EtcdStore.__init__


def circles(package: str, graph: Dict[str, List[str]] = GRAPH) -> List[List[str]]:
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


def test_a_circle_through_several_modules_is_found_and_only_within_the_package():
    graph = {"p.a": ["p.b"], "p.b": ["p.c", "q.x"], "p.c": ["p.a"], "p.d": ["p.a"], "q.x": ["p.d"]}
    assert circles("p", graph) == [["p.a", "p.b", "p.c"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle_within_the_package(package):
    assert circles(package) == []


# ---------------------------------------------------------------------- process-wide state
# The one process-wide pointer of the worker runtime (elastic.runtime.current). Nothing else in
# elastic/ is rebound or mutated at module level; locks are allowed.
SESSION_POINTER = {("elastic.runtime.current", "_session")}
_MUTATORS = {"append", "add", "update", "setdefault", "pop", "popitem", "clear", "extend", "insert", "remove",
             "discard", "appendleft", "put"}


def module_state(source: str) -> List[str]:
    """The module-level names of `source` that hold state: rebound with `global`, mutated in
    place (a container's method that changes it, an item assigned or deleted), or made of a class
    defined in the module (an instance whose attributes change)."""
    tree = ast.parse(source)
    top: Dict[str, ast.AST] = {}
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    top[t.id] = node.value
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found |= set(node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in top:
            found.add(node.func.value.id)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name) and \
                        t.value.id in top:
                    found.add(t.value.id)
    for name, value in top.items():
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in classes:
            found.add(name)
    return sorted(found)


@pytest.mark.parametrize("source, found", [
    ("_lock = threading.Lock()\nTABLE = {1: 2}\ndef f():\n    return TABLE[1]\n", []),
    ("_x = None\ndef f():\n    global _x\n    _x = 1\n", ["_x"]),
    ("_items = []\ndef f(i):\n    _items.append(i)\n", ["_items"]),
    ("_by = {}\ndef f(k):\n    _by[k] = 1\n", ["_by"]),
    ("class Clock:\n    pass\nCLOCK = Clock()\n", ["CLOCK"]),
])
def test_the_module_state_check_sees_state(source, found):
    assert module_state(source) == found


def test_no_module_level_mutable_state_in_elastic_but_the_session_pointer():
    held = {(m, name) for m, p in ALL.items() if m.startswith("elastic") for name in module_state(_read(p))}
    assert held == SESSION_POINTER


# What may run when a module of elastic/ is imported: nothing that registers itself with the
# interpreter, torch or the runtime, but these two, each for a reason its module states.
IMPORT_TIME = {
    # Armed explicitly by `import elastic` under elastic-run only: a torchrun script reaches
    # torch's misleading errors at its top level, before any elastic call.
    ("elastic", "_torch_guidance.install_when_torch_loads"),
    # Registered first so that it runs last at exit, after torch's and the program's atexit functions.
    ("elastic.runtime.preemption", "atexit.register"),
}


def import_time_calls(source: str) -> List[str]:
    """The calls a module makes at its top level (decorators of top-level definitions too)."""
    out = []
    for node in ast.parse(source).body:
        calls = [node.value] if isinstance(node, ast.Expr) else []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            # A decorator that registers what it decorates (atexit.register, a registry's add).
            calls = [d for d in node.decorator_list
                     if ast.unparse(d.func if isinstance(d, ast.Call) else d).rpartition(".")[2].startswith("register")]
        for call in calls:
            if isinstance(call, ast.Call):
                out.append(ast.unparse(call.func))
            elif isinstance(call, ast.Attribute):
                out.append(ast.unparse(call))
    return out


@pytest.mark.parametrize("source, found", [
    ("x = 1\ndef f():\n    hooks.add_hooks(H())\n", []),
    ("hooks.add_hooks(_GroupHooks())\n", ["hooks.add_hooks"]),
    ("@atexit.register\ndef bye():\n    pass\n", ["atexit.register"]),
    ('"""doc"""\nif X:\n    pass\n', []),
])
def test_the_import_time_check_sees_registrations(source, found):
    assert import_time_calls(source) == found


def test_nothing_registers_itself_when_a_module_of_elastic_is_imported():
    made = {(m, call) for m, p in ALL.items() if m.startswith("elastic") and not m.endswith("__main__")
            for call in import_time_calls(_read(p))}
    assert made == IMPORT_TIME


# ---------------------------------------------------------------------- sizes and names
def _lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def _source_files() -> List[str]:
    return sorted(os.path.relpath(p, REPO) for p in ALL.values()
                  if os.sep + "_proto" + os.sep not in p)   # generated by grpcio-tools


def test_every_source_file_is_at_most_700_lines():
    long = {f: n for f in _source_files() if (n := _lines(os.path.join(REPO, f))) > MAX_LINES}
    assert long == {}


def test_every_package_says_what_it_owns():
    missing = [m for m, p in ALL.items()
               if p.endswith("__init__.py") and ast.get_docstring(ast.parse(_read(p))) is None]
    assert missing == []


def redefined(source: str) -> List[str]:
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


@pytest.mark.slow
def test_no_module_of_the_project_or_its_tests_defines_a_name_twice():
    roots = PACKAGES + ("tests", "bench", "examples")
    paths = sorted(os.path.join(d, f) for root in roots for d, _, files in os.walk(os.path.join(REPO, root))
                   for f in files if f.endswith(".py") and os.sep + "_proto" + os.sep not in os.path.join(d, f))
    twice = {}
    for path in paths:
        if found := redefined(_read(path)):
            twice[os.path.relpath(path, REPO)] = found
    assert twice == {}
