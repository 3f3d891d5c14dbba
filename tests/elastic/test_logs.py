"""The runtime's log handler (elastic.runtime.logs): installed when asked, never over a script's own
logging configuration; in fresh interpreters, as a worker is."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow   # real processes, servers or rings: not in the fast lane

SCRIPT = """
import logging, sys
{setup}
from elastic.runtime import logs
print(logs.install({level!r}))
logging.getLogger("elastic").info("rank line")
logging.getLogger("elastic").warning("warning line")
"""


@pytest.mark.parametrize("setup, level, installed, shown", [
    ("", "INFO", True, ["INFO elastic: rank line", "WARNING elastic: warning line"]),
    ("", "WARNING", True, ["WARNING elastic: warning line"]),
    ("", None, False, ["warning line"]),                     # not asked: Python's last-resort handler
    ("logging.basicConfig(level=logging.WARNING, format='%(message)s')", "INFO", False, ["warning line"]),
    ("logging.getLogger('elastic').setLevel(logging.ERROR)", "INFO", False, []),
])
def test_the_runtime_logs_its_lines_unless_the_script_configured_logging(setup, level, installed, shown):
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(setup=setup, level=level)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(installed)
    assert out.stderr.splitlines() == shown
