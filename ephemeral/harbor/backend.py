"""The runtime Harbor's environments share: one per event loop, in this process.

Harbor runs its concurrent trials (``-n``) as tasks of one loop; each trial's environment
holds the runtime from ``start`` to ``stop``. When the last one lets go the runtime lingers a
few seconds for the next trial (``-n 1`` starts them one after another), then closes; when
Harbor's loop ends first, the cancelled linger closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from ephemeral.engine.runtime import Runtime
from ephemeral.settings import Settings

LINGER_SECONDS = 5.0


@dataclass
class _Held:
    runtime: Runtime
    org_id: str
    users: int = 0
    closer: asyncio.Task[None] | None = None


_by_loop: dict[asyncio.AbstractEventLoop, _Held] = {}
_locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}


async def acquire() -> tuple[Runtime, str]:
    """The loop's runtime and its local org; starts it (reaping what a killed process left)."""
    loop = asyncio.get_running_loop()
    async with _locks.setdefault(loop, asyncio.Lock()):
        held = _by_loop.get(loop)
        if held is None:
            # No warm pool: a pooled sandbox has the pool's limits, a trial gets the task's.
            settings = Settings.load(pool_size=0)
            runtime = await Runtime.start(settings, warm_pool=False, recover=True)
            held = _Held(runtime, await runtime.local_org())
            _by_loop[loop] = held
        if held.closer is not None:
            held.closer.cancel()
            held.closer = None
        held.users += 1
        return held.runtime, held.org_id


def release() -> None:
    loop = asyncio.get_running_loop()
    held = _by_loop.get(loop)
    if held is None:
        return
    held.users -= 1
    if held.users <= 0 and held.closer is None:
        held.closer = loop.create_task(_linger(loop, held), name="ephemeral-harbor-runtime")


async def _linger(loop: asyncio.AbstractEventLoop, held: _Held) -> None:
    try:
        await asyncio.sleep(LINGER_SECONDS)
    except asyncio.CancelledError:
        if held.closer is None:  # re-acquired: it stays
            raise
    if _by_loop.get(loop) is held and held.users <= 0:
        del _by_loop[loop]
        with contextlib.suppress(Exception):
            await held.runtime.close()
