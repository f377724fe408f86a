"""One real run whose process SIGKILLs itself at a named step boundary (tests/run/test_crash.py).

``python -m tests.run.crash_child BOUNDARY STATE_DIR CASSETTES_DIR MODEL``. The boundary is
reached by wrapping the store method or agent step that ends it: the process dies right after
that step's transaction committed, with nothing of the next step done.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ephemeral.agent.loop import PLAIN_STEPS
from ephemeral.engine import close as closing
from ephemeral.lifecycle import RunStatus
from ephemeral.policy import RunRequest
from ephemeral.settings import Settings
from ephemeral.store.runs import Runs
from tests import runlevel


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _after(owner: Any, name: str, when: Callable[..., bool] = lambda *a, **k: True) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = await original(*args, **kwargs)
        if when(*args, **kwargs):
            _die()
        return result

    setattr(owner, name, wrapped)


def _after_sync(owner: Any, name: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        _die()
        return result

    setattr(owner, name, wrapped)


def _to(status: RunStatus) -> Callable[..., bool]:
    return lambda *args, **kwargs: kwargs.get("to") == status


BOUNDARIES: dict[str, Callable[[], None]] = {
    "admitted": lambda: _after(Runs, "admit"),
    "provisioning": lambda: _after(Runs, "transition", _to(RunStatus.PROVISIONING)),
    "sandbox.ready": lambda: _after(Runs, "transition", _to(RunStatus.RUNNING)),
    # The loop holds the step callables in PLAIN_STEPS: wrapping the methods would not reach it.
    "model_step": lambda: _after(PLAIN_STEPS, "model_step"),
    "tool_step": lambda: _after(PLAIN_STEPS, "tool_step"),
    "teardown": lambda: _after(PLAIN_STEPS, "teardown"),
    "closed": lambda: _after(Runs, "close"),
    # The record's files are written, its `recorded` marker is not.
    "recorded": lambda: _after_sync(closing, "record_run"),
}


async def main(boundary: str, state_dir: str, cassettes_dir: str, model: str) -> None:
    settings = Settings.load(
        state_dir=Path(state_dir), cassettes_dir=Path(cassettes_dir), use_prefect=False
    )
    # Recovery is the test's to run, after every child has died.
    async with runlevel.started(settings, check=False, recover=False, watchdog=False) as runtime:
        BOUNDARIES[boundary]()  # it SIGKILLs this process there, the run left open
        request = RunRequest(prompt="crash test", model=model, timeout_seconds=120)
        row, _ = await runtime.admit(await runtime.local_org(), request)
        await runtime.execute(row.id)
    raise SystemExit(f"the run ended without reaching the boundary {boundary!r}")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
