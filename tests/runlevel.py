"""What a test's runtime must not leave behind, at run level: the sandbox fixture's check
(tests/sandbox/conftest.py) one level up. Every runtime a test starts is started here, through
:func:`started` (the ``runtime`` fixtures of tests/run, tests/sessions, tests/api, tests/broker
and tests/gateway, and the tests that start one of their own; tests/test_runtime_starts.py fails
on a ``Runtime.start`` anywhere else in tests/), so the check runs around closing each runtime
and a test need not check by hand. ``check=False`` only where a test leaves runs open on
purpose, each named with its reason in tests/test_runtime_starts.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import sqlalchemy as sa

from ephemeral.engine.runtime import Runtime
from ephemeral.settings import Settings
from ephemeral.store import Store
from ephemeral.store.schema import orgs

# A session ended by its watchdog writes its record after it settles: the check waits for it,
# bounded only against a hung writer (every check of every test that starts a runtime waits
# here, and at load 30 on these 2 cores one step of a run can take tens of seconds).
RECORD_WAIT_SECONDS = 300.0


async def before_close(runtime: Runtime) -> list[str]:
    """Every settled run is recorded (waiting for records still being written)."""
    deadline = time.monotonic() + RECORD_WAIT_SECONDS
    while unrecorded := await runtime.store.runs.unrecorded():
        if time.monotonic() > deadline:
            return [f"run {r.id} is settled but not recorded" for r in unrecorded]
        await asyncio.sleep(0.1)
    return []


async def after_close(runtime: Runtime) -> list[str]:
    """Once the runtime closed (its sessions ended): no open run, nothing reserved on any
    org, no run state (handle) in the engine, no sandbox handle file."""
    left = [f"the engine still holds run {r}" for r in runtime.engine.runs]
    handles = runtime.settings.sandboxes_dir.glob("*.json")
    left += [f"sandbox handle {p.name} is left" for p in handles]
    store = await Store.open(runtime.settings.db_url)
    try:
        left += [f"run {r.id} is still {r.status}" for r in await store.runs.open()]
        async with store.engine.connect() as conn:
            held = (
                await conn.execute(
                    sa.select(orgs.c.name, orgs.c.reserved_micros).where(
                        orgs.c.reserved_micros != 0
                    )
                )
            ).all()
    finally:
        await store.close()
    left += [f"org {name} still holds {micros} micros" for name, micros in held]
    return left


@contextlib.asynccontextmanager
async def started(
    settings: Settings,
    *,
    check: bool = True,
    opener: Callable[..., Awaitable[Runtime]] | None = None,
    **start: Any,
) -> AsyncIterator[Runtime]:
    """A runtime on ``settings`` (``start``: :meth:`Runtime.start`'s keywords; ``opener``: another
    way to start one, such as ``serve``'s ``start_runtime``) for a test or its fixture, closed
    after it; what it left behind (:func:`before_close`, :func:`after_close`) fails the test
    unless ``check`` is off."""
    rt = await (opener or Runtime.start)(settings, **start)
    left: list[str] = []
    try:
        yield rt
        if check:
            left = await before_close(rt)
    finally:
        await rt.close()
    if check:
        left += await after_close(rt)
        assert not left, f"the test left: {left}"
