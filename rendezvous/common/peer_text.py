"""Text a peer chose (a failure reason, a host name, an event detail), made safe to show.

The server writes it into log lines and events, and `elastic-rendezvous status` onto a terminal:
either side escapes it here first, so it can neither forge a log line nor drive a terminal.
"""
from __future__ import annotations

SHOWN_CHARS = 200             # peer-supplied text is cut to this in logs and events


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """Text a peer chose, as it may appear in a log line or an event: characters that are not
    printable (newlines, terminal escapes, bidi overrides) written as escapes, at most `limit`
    characters, so it can neither forge log lines nor drive a terminal."""
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return out if len(out) <= limit else out[:limit - 3] + "..."
