"""Every block a reader copies from the docs is checked: Python blocks compile, every
`elastic-run` and `elastic-rendezvous` command line parses with the real parser, every script a
command names exists, and the README's training script runs as written, without warnings."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from elastic.launch.flags import UsageError, parser as launch_parser
from rendezvous.cli import parser as rendezvous_parser

from .docs_text import REPO, blocks, page, pages

SHELL = ("bash", "sh", "console")


def _commands(block: str) -> list:
    """The command lines of a shell block: continuations joined, prompts and comments dropped."""
    lines, current = [], ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if line.startswith("$ "):
            line = line[2:]
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if current.strip():
                lines.append(current.strip())
            current = ""
    return lines


def _words(line: str) -> list:
    words = shlex.split(line, comments=True)
    while words and ("=" in words[0] and not words[0].startswith("-") or words[0] in ("sudo", "srun", "exec")):
        words.pop(0)   # VAR=value, and the wrappers a command runs under
    return words


def _shell_lines():
    """Command lines of the shell blocks, and the inline launches of the prose (`elastic-run
    --np 4 -- python train.py`) written out whole (no placeholder such as … or N)."""
    for name in pages():
        text = page(name)
        for block in (b for lang in SHELL for b in blocks(text, lang)):
            for line in _commands(block):
                yield name, line
        for span in re.findall(r"(?<!`)`((?:elastic-run|elastic-rendezvous) [^`]+)`(?!`)", text):
            if " -- " in span and not re.search(r"…|\.\.\.|<[A-Za-z]|\b[A-Z]\b|HOST:PORT|SCRIPT|\[", span):
                yield name, span


def test_every_python_block_compiles():
    failures = []
    for name in pages():
        for i, block in enumerate(blocks(page(name), "python")):
            try:
                compile(block, f"{name} block {i}", "exec")
            except SyntaxError as e:
                failures.append(f"{name} block {i}: {e}")
    assert failures == []


def test_the_docs_have_python_and_shell_blocks_to_check():
    assert sum(len(blocks(page(n), "python")) for n in pages()) >= 6
    assert sum(1 for _ in _shell_lines()) >= 20


def test_every_documented_command_line_parses_with_the_real_parser():
    failures, seen = [], {"elastic-run": 0, "elastic-rendezvous": 0}
    for name, line in _shell_lines():
        words = _words(line)
        if not words or words[0] not in seen:
            continue
        seen[words[0]] += 1
        make = launch_parser if words[0] == "elastic-run" else rendezvous_parser
        try:
            make().parse_args(words[1:])
        except SystemExit as e:   # --help, --version
            if e.code != 0:
                failures.append(f"{name}: {line!r}: exit {e.code}")
        except UsageError as e:
            failures.append(f"{name}: {line!r}: {e}")
    assert failures == []
    assert seen["elastic-run"] >= 6 and seen["elastic-rendezvous"] >= 3, seen


def test_every_script_a_documented_command_runs_exists():
    missing = []
    for name, line in _shell_lines():
        for word in _words(line):
            if word.startswith(("examples/", "bench/")) and word.endswith((".py", ".sbatch")):
                if not os.path.exists(os.path.join(REPO, word)):
                    missing.append(f"{name}: {word}")
    assert missing == []


def test_the_readme_states_the_two_commands_and_is_a_front_page():
    readme = page("README.md")
    assert len(readme.splitlines()) <= 200
    assert blocks(readme, "bash")[0] == "pip install -e '.[test]'\npytest\n"
    # What is supported and what is not, in the first screen.
    assert "CPU tensors" in "\n".join(readme.splitlines()[:20])
    assert "elastic-run --np 4" in readme


@pytest.mark.slow
def test_the_readme_training_script_runs_as_written_without_warnings(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(next(b for b in blocks(page("README.md"), "python") if "@elastic.run" in b))
    env = dict(os.environ, PYTHONWARNINGS="default")
    p = subprocess.run([sys.executable, "-m", "elastic.launch", "--np", "2", "--", sys.executable, str(script)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "completed" in out
    assert "Warning" not in out and "WARNING" not in out, out[-3000:]
