"""The embedded Prefect server's process: Prefect's own uvicorn command, ended when the process
that started it is gone.

Prefect starts its embedded server with ``python -m uvicorn …`` and stops it only from an
``atexit`` hook, which neither SIGKILL nor Python's default SIGTERM runs: each ``serve``,
``run`` or ``eval`` killed that way left the server running (~200 MB, its port held).
:func:`ephemeral.flows.embedded_server.guard_embedded_server` makes Prefect run ``python -m
ephemeral.flows.embedded_prefect …`` with the same arguments instead. This module watches its parent
(a process whose parent dies is reparented, so ``getppid()`` changes; unlike ``PR_SET_PDEATHSIG``
this does not fire when merely the *thread* that started it ends), and when the parent is gone asks
uvicorn to stop (SIGTERM), then kills itself after a grace period.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time
from typing import Final

# The pid of the process that started the server, set by the launcher: if it died before this
# module ran, getppid() is already someone else's and the server must not start.
PARENT_ENV: Final = "EPHEMERAL_PREFECT_PARENT_PID"
POLL_SECONDS: Final = 0.5
GRACE_SECONDS: Final = 10.0


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful stop
    time.sleep(GRACE_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parent = int(os.environ.pop(PARENT_ENV, "") or os.getppid())
    if os.getppid() != parent:
        sys.exit(0)  # orphaned before it started
    threading.Thread(target=_watch, args=(parent,), name="parent-watch", daemon=True).start()
    sys.argv = ["uvicorn", *sys.argv[1:]]
    runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
