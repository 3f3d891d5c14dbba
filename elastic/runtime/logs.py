"""The worker's own log lines without the script configuring logging: a handler on the
"elastic" logger, installed when the launcher asks (ELASTIC_LOG_LEVEL, from elastic-run
--log-level / --quiet).

Python prints only WARNING and above of a library that logs to an unconfigured logging, so
"worker w0 is rank 0 of 4 in world version 3" or "on standby" would need the script to call
logging.basicConfig. A script that configured logging itself (a handler on the root logger or
on "elastic", or a level set on "elastic") keeps its own: nothing is installed then. Records
handled here do not also go to the root logger, so a basicConfig called later does not print
them twice.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

FORMAT = "%(levelname)s %(name)s: %(message)s"


class _Installed(logging.StreamHandler):
    """The handler this module installs (told apart from a user's own)."""


def install(level: Optional[str]) -> bool:
    """Installs the handler at ``level`` ("DEBUG", "INFO", …; None: nothing asked) unless logging
    is configured already; returns whether it did."""
    if not level:
        return False
    logger = logging.getLogger("elastic")
    if any(isinstance(h, _Installed) for h in logger.handlers):
        return False
    if logging.getLogger().handlers or logger.handlers or logger.level != logging.NOTSET:
        return False   # the script's own logging configuration decides
    handler = _Installed(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return True
