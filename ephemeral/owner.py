"""Which process owns a run or a sandbox, and whether that process is still alive.

An owner is ``host:pid:start`` where ``start`` is the process start time in clock ticks since
boot (``/proc/<pid>/stat`` field 22), so a recycled pid is not mistaken for the owner.
"""

from __future__ import annotations

import os
import socket
from functools import cache


def _start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


@cache
def this_process() -> str:
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_ticks(pid)}"


def is_alive(owner: str | None) -> bool | None:
    """True/False for an owner on this host; None when it belongs to another host."""
    if not owner:
        return False
    try:
        host, pid_s, start = owner.rsplit(":", 2)
        pid = int(pid_s)
    except ValueError:
        return False
    if host != socket.gethostname():
        return None
    return _start_ticks(pid) == start
