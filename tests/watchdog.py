"""What the test harnesses start goes when the test process goes, however it goes.

A killed pytest (SIGKILL, CI's time limit, the OOM killer) runs no finalizer and no ``atexit``,
and the servers the harnesses start run in sessions of their own (so that a test can signal one
whole tree): tests/cluster/harness.py's ``serve`` and workers, tests/evals/prefect_server.py's
Prefect servers, tests/fixtures_pg.py's PostgreSQL (``pg_ctl`` detaches it). They would outlive
the test process. So each test process has a watchdog: a small process in a session of its own
that reads orders on a pipe, ``watch PGID SIGNAL`` / ``forget PGID`` and ``remove PATH`` /
``keep PATH``. When the pipe ends (the kernel closes the test process's end when it dies; a test
process that ends normally closes it too) the watchdog signals every process group still
watched, waits for them to go, then removes every path still listed.

The pipe's write end is close-on-exec, so no server started here holds it open.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

# The watchdog itself: only the standard library, so it starts in a moment.
_SCRIPT = r"""
import os, shutil, signal, sys, time
groups, paths = {}, []
for line in sys.stdin:
    order, _, arg = line.rstrip("\n").partition(" ")
    if order == "watch":
        pgid, sig = arg.split()
        groups[int(pgid)] = int(sig)
    elif order == "forget":
        groups.pop(int(arg), None)
    elif order == "remove":
        paths.append(arg)
    elif order == "keep" and arg in paths:
        paths.remove(arg)
for pgid, sig in groups.items():
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass
def live_groups():
    # a zombie is gone (orphans' zombies may never be reaped here: pid 1 need not reap them)
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            raw = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2 :].split()
        if fields[0] not in ("Z", "X"):
            found.add(int(fields[2]))
    return found
deadline = time.monotonic() + 30
while groups and time.monotonic() < deadline:
    groups = {g: s for g, s in groups.items() if g in live_groups()}
    time.sleep(0.1)
for pgid in groups:  # a group that ignored a gentler signal
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
for path in paths:
    shutil.rmtree(path, ignore_errors=True)
"""

_lock = threading.Lock()
_proc: subprocess.Popen[str] | None = None
_pid = 0  # the process that started the watchdog: a fork must start its own


def _order(line: str) -> None:
    global _proc, _pid
    with _lock:
        if _proc is None or _pid != os.getpid():
            _proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _SCRIPT],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,  # not in the test process's group: it must outlive it
            )
            _pid = os.getpid()
        assert _proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            _proc.stdin.write(line + "\n")
            _proc.stdin.flush()


def watch(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal the process group ``pgid`` with ``sig`` if the test process ends first."""
    _order(f"watch {pgid} {int(sig)}")


def forget(pgid: int) -> None:
    """The group was stopped by its owner (its id may be reused: never signal it)."""
    _order(f"forget {pgid}")


def remove(path: Path) -> None:
    """Remove the directory ``path`` if the test process ends first (after the groups went)."""
    _order(f"remove {path}")


def keep(path: Path) -> None:
    _order(f"keep {path}")
