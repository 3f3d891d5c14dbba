"""The documentation's generated references: the command lines from their argparse parsers and the
worker's environment from its one table, so the pages cannot drift from the code.

mkdocs runs this as a hook (mkdocs.yml `hooks:`): a page holding a marker line such as
``<!-- generated: cli elastic-run -->`` gets the generated text in its place. tests/docs imports the
same functions to compare the references with the code."""
from __future__ import annotations

import argparse
import os
import re

MARKER = re.compile(r"^<!-- generated: (\w+)(?: ([\w-]+))? -->$", re.M)


def _parsers() -> dict:
    from elastic.launch.flags import parser as launch_parser
    from rendezvous.cli import parser as rendezvous_parser
    return {"elastic-run": launch_parser, "elastic-rendezvous": rendezvous_parser}


def _subcommands(p: argparse.ArgumentParser) -> dict:
    for action in p._actions:   # argparse has no public way to list subcommands
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help(p: argparse.ArgumentParser) -> str:
    # A fixed width, so the page does not depend on the terminal that built it.
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        return p.format_help()
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def cli_reference(program: str) -> str:
    """``PROGRAM --help`` and each subcommand's, as the installed version prints them."""
    p = _parsers()[program]()
    parts = [f"```text\n$ {program} --help\n{_help(p).rstrip()}\n```\n"]
    for name, sub in _subcommands(p).items():
        parts.append(f"### `{program} {name}`\n\n```text\n$ {program} {name} --help\n{_help(sub).rstrip()}\n```\n")
    return "\n".join(parts)


def option_strings(program: str) -> set:
    """Every flag PROGRAM and its subcommands accept (tests compare the page with these)."""
    p = _parsers()[program]()
    found = set()
    for q in [p, *_subcommands(p).values()]:
        for action in q._actions:
            if action.help != argparse.SUPPRESS:   # torchrun's spellings, accepted but not listed
                found.update(s for s in action.option_strings if s.startswith("--"))
    return found


def environment_table() -> str:
    """The worker's environment table (elastic/runtime/worker_config.py's docstring, its one home)."""
    from elastic.runtime import worker_config
    doc = worker_config.__doc__
    start = doc.index("| variable |")
    end = doc.index("\n\n", start)
    return doc[start:end].replace("``", "`") + "\n"


def documented_variables() -> set:
    return set(re.findall(r"`(ELASTIC_[A-Z_]+)`", environment_table()))


def api_paths() -> list:
    """(public name, the path mkdocstrings documents it under) for each of ``elastic.__all__``: the
    module that defines it, since a lazily loaded name has no static home in ``elastic``."""
    import elastic
    from elastic.ring.ops import ReduceOp
    for name in elastic.__all__:
        getattr(elastic, name)   # load the lazy names, so their modules are imported
    paths = []
    for name in sorted(elastic.__all__, key=str.lower):
        obj = getattr(elastic, name)
        if isinstance(obj, ReduceOp):
            continue   # Sum, Average, Min, Max: the members of ReduceOp, documented there
        paths.append((name, f"{_home(name, obj)}.{name}"))
    return paths


def _home(name: str, obj) -> str:
    """The module that defines ``obj``: the public errors say ``elastic`` in ``__module__`` (as a
    user meets them), so look for the submodule that holds the object under its name."""
    import sys
    module = getattr(obj, "__module__", "elastic")
    if module != "elastic":
        return module
    homes = [m for m, mod in list(sys.modules.items())
             if m.startswith("elastic.") and getattr(mod, name, None) is obj
             and name in getattr(mod, "__dict__", {}) and not m.endswith("__init__")]
    # The defining module is the one whose source has the class statement.
    for m in homes:
        if f"class {name}" in (getattr(sys.modules[m], "__file__", "") and open(sys.modules[m].__file__).read()):
            return m
    return "elastic"


def _native_doc(name: str) -> str:
    """The native core's types have no Python source for mkdocstrings to read: their docstrings,
    and an enum's members, as the loaded module gives them."""
    import enum
    import inspect
    import elastic
    obj = getattr(elastic, name)
    text = inspect.cleandoc(obj.__doc__ or "")
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        text += "\n\n" + "\n".join(f"- `{m.name}`" for m in obj)
    return text


def api_reference() -> str:
    def block(name: str, path: str) -> str:
        if "._native." in path:
            return f"## `elastic.{name}`\n\n{_native_doc(name)}\n"
        return f"## `elastic.{name}`\n\n::: {path}\n    options:\n      show_root_heading: false\n"
    return "\n".join(block(name, path) for name, path in api_paths())


def render(markdown: str) -> str:
    def one(m: re.Match) -> str:
        kind, arg = m.group(1), m.group(2)
        if kind == "cli":
            return cli_reference(arg)
        if kind == "api":
            return api_reference()
        if kind == "environment":
            return environment_table()
        raise ValueError(f"unknown generated section {kind!r} (docs/hooks/reference.py)")
    return MARKER.sub(one, markdown)


def on_page_markdown(markdown, page, config, files):   # the mkdocs hook
    return render(markdown)
