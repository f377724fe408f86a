"""``python -m tests.cluster.crash_api POINT serve …``: ``ephemeral`` that kills itself (SIGKILL,
as ``kill -9`` would) at one point of its first admission (tests/cluster/test_drain_admission.py).

- ``after-reservation``: inside the admission's transaction, after the budget is reserved and
  the row inserted, before the commit (PostgreSQL rolls it back);
- ``after-row``: the admission committed, nothing handed to Prefect;
- ``before-prefect``: about to create the run's task run;
- ``after-prefect``: the task run created, the run not yet marked dispatched.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from typing import Any

POINTS = ("after-reservation", "after-row", "before-prefect", "after-prefect")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _after(fn: Any) -> Any:
    @functools.wraps(fn)
    async def wrapped(*args: Any, **kw: Any) -> Any:
        await fn(*args, **kw)
        _die()

    return wrapped


def _before(fn: Any) -> Any:
    @functools.wraps(fn)
    async def wrapped(*args: Any, **kw: Any) -> Any:
        _die()

    return wrapped


def install(point: str) -> None:
    """Patch once ``serve`` has configured Prefect (importing it earlier would freeze its
    settings before ``configure`` sets them)."""
    from ephemeral import prefect_setup

    if point not in POINTS:
        raise SystemExit(f"point must be one of {', '.join(POINTS)}")
    configure = prefect_setup.configure

    def configured(settings: Any) -> None:
        configure(settings)
        _patch(point)

    prefect_setup.configure = configured


def _patch(point: str) -> None:
    from ephemeral.flows import dispatch
    from ephemeral.store import ledger
    from ephemeral.store.runs import Runs

    if point == "after-reservation":
        ledger.admit = _after(ledger.admit)  # type: ignore[method-assign]
    elif point == "after-row":
        Runs.admit = _after(Runs.admit)  # type: ignore[method-assign]
    elif point == "before-prefect":
        dispatch.create_task_run = _before(dispatch.create_task_run)
    else:
        dispatch.create_task_run = _after(dispatch.create_task_run)


if __name__ == "__main__":
    install(sys.argv[1])
    sys.argv = ["ephemeral", *sys.argv[2:]]
    from ephemeral.cli import main

    main()
