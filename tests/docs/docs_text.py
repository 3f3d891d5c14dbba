"""The documentation as tests read it: pages, their fenced blocks, and the generated references."""
from __future__ import annotations

import importlib.util
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "docs")

_BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```$", re.S | re.M)


def page(name: str) -> str:
    """A page by its path under docs/ ("guides/ddp.md"), or "README.md"."""
    path = os.path.join(REPO, name) if name == "README.md" else os.path.join(DOCS, name)
    with open(path) as f:
        return f.read()


def pages() -> list:
    """Every Markdown page of the site, and the README."""
    found = ["README.md"]
    for root, _, files in os.walk(DOCS):
        found += sorted(os.path.relpath(os.path.join(root, f), DOCS) for f in files if f.endswith(".md"))
    return found


def blocks(text: str, language: str) -> list:
    return [m.group(2) for m in _BLOCK.finditer(text) if m.group(1) == language]


def block_after(text: str, language: str, after: str) -> str:
    """The first ```language block after the line containing ``after``."""
    start = text.index(after)
    for m in _BLOCK.finditer(text, start):
        if m.group(1) == language:
            return m.group(2)
    raise AssertionError(f"no ```{language} block after {after!r}")


def reference():
    """docs/hooks/reference.py, the generator the site's build runs."""
    spec = importlib.util.spec_from_file_location("docs_reference", os.path.join(DOCS, "hooks", "reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
