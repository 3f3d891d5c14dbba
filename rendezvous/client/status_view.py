"""What `elastic-rendezvous status` prints: the table of jobs, worlds and members, and the live view
of `status --watch` (redrawn in place on a terminal, one snapshot otherwise, like `top -b -n1`).

Everything shown that came from the server (job ids, hosts, reasons, event details) is escaped
first (`safe`): a peer chose that text, and it must not drive the terminal.
"""
from __future__ import annotations

import shutil
import sys
import time
from typing import Callable, Optional, Sequence, TextIO

from rendezvous.wire.membership import StragglerReport
from rendezvous.common.peer_text import shown
from rendezvous.client.status_client import StatusError, StatusInfo

HOME, CLEAR_LINE, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
FIELD_CHARS = 120      # one field of the table at most (a reason, a host)


def safe(text: str, limit: int = FIELD_CHARS) -> str:
    """Server-supplied text as it may be shown: control characters escaped, at most `limit`."""
    return shown(str(text), limit)


def format_age(seconds: float) -> str:
    """A duration in the table: 42s, 3m07s, 5h02m, 3d04h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_pace(report: Optional[StragglerReport]) -> str:
    """The PACE column: a member's compute time over its world's median in its last commit
    window (elastic/runtime/straggler_detector.py), and STRAGGLER once it was slow for the job's number of
    windows; "-" before its first judged window."""
    if report is None:
        return "-"
    return f"{report.score:.2f}x" + (" STRAGGLER" if report.named else "")


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_status(status: StatusInfo, events: int = 0) -> str:
    """The jobs as a table; with `events`, the last that many events of all jobs after it."""
    lines = [f"leader: {safe(status.leader_id) or '(answered by a follower, from the store)'}"]
    if not status.jobs:
        lines.append("no jobs")
    for j in status.jobs:
        lines.append("")
        lines.append(f"job {safe(j.job_id)}  phase {safe(j.phase)}  world {j.world_version}  "
                     f"np {j.min_np}..{j.max_np}" + (f"  ({safe(j.reason)})" if j.reason else "")
                     + (f"  blacklisted: {safe(','.join(j.blacklisted_hosts))}"
                        if j.blacklisted_hosts else ""))
        # COMMIT counts the worker's commits; STEP is the training step it is at (its state's
        # `step`, "-" when it has none): the two differ, and a reader needs both.
        rows = [("RANK", "WORKER", "HOST", "LOCAL", "CROSS", "RING ADDRESS", "COMMIT", "STEP", "PACE", "ATTACHED",
                 "AGE")]
        for m in j.members:
            rows.append((str(m.rank) if m.in_world else "standby", safe(m.worker_id), safe(m.host),
                         f"{m.local_rank}/{m.local_size}" if m.in_world else "-",
                         f"{m.cross_rank}/{m.cross_size}" if m.in_world else "-",
                         safe(m.ring_address), str(m.commit_step), str(m.step) if m.step >= 0 else "-",
                         format_pace(m.straggler),
                         "yes" if m.attached else "no", format_age(m.age_s)))
        lines += _table(rows)
    if events:
        lines += [""] + format_events(status, events)
    return "\n".join(lines)


def format_events(status: StatusInfo, n: int) -> list[str]:
    """The last `n` events of every job in the answer, oldest first."""
    evs = sorted(((e, j.job_id) for j in status.jobs for e in j.events), key=lambda x: x[0].time)
    evs = evs[-n:]
    if not evs:
        return ["recent events: none"]
    rows = [("TIME", "JOB", "WORLD", "EVENT", "WORKER", "DETAIL")]
    for e, job_id in evs:
        stamp = time.strftime("%H:%M:%S", time.localtime(e.time)) + f".{int(e.time * 1000) % 1000:03d}"
        rows.append((stamp, safe(job_id), str(e.world_version), safe(e.event), safe(e.worker_id) or "-",
                     safe(e.detail)))
    return ["recent events:"] + _table(rows)


def fit(text: str, width: int, height: int) -> list[str]:
    """The lines of `text` cut to the terminal (no line wraps; what does not fit is left out,
    the last line saying how much)."""
    lines = [line[:width] for line in text.split("\n")]
    if len(lines) > height:
        cut = len(lines) - (height - 1)
        lines = lines[:height - 1] + [f"... {cut} more line(s); enlarge the terminal"[:width]]
    return lines


def frame(header: str, body: str, width: int, height: int) -> str:
    """One redraw: cursor home, every line cleared to its end, the rest of the screen cleared."""
    lines = fit(header + "\n" + body, width, height)
    return HOME + "".join(line + CLEAR_LINE + "\r\n" for line in lines[:-1]) + lines[-1] + \
        CLEAR_LINE + CLEAR_BELOW


def watch(fetch: Callable[[], StatusInfo], *, server: str, interval_s: float, events: int,
          out: TextIO = sys.stdout, tty: Optional[bool] = None,
          sleep: Callable[[float], None] = time.sleep) -> int:
    """`status --watch`: on a terminal, redraw every `interval_s` until Ctrl-C (exit 0), showing an
    error line and retrying while no server answers; otherwise print one snapshot and return
    (0, or 1 when no server answered)."""
    if tty is None:
        tty = out.isatty()
    if not tty:
        try:
            status = fetch()
        except StatusError as e:
            print(f"elastic-rendezvous status: {safe(str(e), 400)}", file=sys.stderr)
            return 1
        out.write(format_status(status, events) + "\n")
        out.flush()
        return 0
    last: Optional[StatusInfo] = None
    last_at = 0.0
    out.write(HIDE_CURSOR)
    try:
        while True:
            error = ""
            try:
                last, last_at = fetch(), time.time()
            except StatusError as e:
                error = safe(str(e), 400)
            header = (f"elastic-rendezvous status --watch  {safe(server)}  every {interval_s:g} s  "
                      f"{time.strftime('%H:%M:%S')}  (Ctrl-C quits)")
            if error:
                header += (f"\nerror: {error}; retrying"
                           + (f" (the table is from {format_age(time.time() - last_at)} ago)"
                              if last is not None else ""))
            body = format_status(last, events) if last is not None else ""
            size = shutil.get_terminal_size((120, 40))
            out.write(frame(header, body, size.columns, size.lines))
            out.flush()
            sleep(interval_s)
    except KeyboardInterrupt:
        return 0
    finally:
        out.write(SHOW_CURSOR + "\r\n")
        out.flush()
