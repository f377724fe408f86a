"""Destroy sandboxes whose owner is gone, from their persisted handles.

Run at start-up and by ``ephemeral sandbox reap``. A handle is reaped when the host process that
created it is dead (checked with its start time, so a reused pid does not count as alive), or,
for run-owned sandboxes (owner ``run_…``), when ``is_owner_alive(owner)`` says the run is
terminal or unknown. Pool and probe sandboxes belong to their host process only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ephemeral import errors
from ephemeral.ids import RUN_ID_RE
from ephemeral.sandbox import handles
from ephemeral.settings import Settings

log = logging.getLogger(__name__)


async def reap(
    settings: Settings, *, is_owner_alive: Callable[[str], Awaitable[bool]] | None = None
) -> list[str]:
    destroyed: list[str] = []
    for path, handle in await asyncio.to_thread(handles.read_all, settings.sandboxes_dir):
        if handle is None:
            continue  # unreadable: we cannot know what it owns; `ephemeral sandbox reap` lists it
        dead = not handles.pid_alive(handle.host_pid, handle.host_start_time)
        if not dead and is_owner_alive is not None and RUN_ID_RE.match(handle.owner):
            dead = not await is_owner_alive(handle.owner)
        if dead:
            try:
                await asyncio.to_thread(handles.teardown, handle, path)
            except errors.SandboxError as exc:
                # one stuck sandbox must not keep the others alive; the next reap retries it
                log.warning("reaper: %s: %s", handle.id, exc)
                continue
            destroyed.append(handle.id)
    return destroyed


def unreadable_handles(settings: Settings) -> list[str]:
    return [str(p) for p, h in handles.read_all(settings.sandboxes_dir) if h is None]
