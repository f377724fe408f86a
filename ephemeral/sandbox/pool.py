"""A warm pool of started, never-used sandboxes; each is handed out once.

``acquire`` returns a warm sandbox at once when one is ready (re-owned to the caller and with
its lifetime restarted), else creates one cold. A background task keeps ``size`` warm ones,
replaces any that died idle, and backs off when creation fails.

Boots are paced: at most ``boots`` sandboxes start at once (a semaphore the pool may share with
its runtime), in the order they were asked for, and the refill waits behind the callers. A
burst of a hundred then comes up a few at a time, so the first become usable within a few
boots instead of all together at the end (they share the same cores either way).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from ephemeral import errors
from ephemeral.sandbox.base import Limits, Sandbox, SandboxDriver

log = logging.getLogger(__name__)
POOL_OWNER = "pool"
CHECK_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0


BOOTS_PER_CORE = 4


def boots_at_once() -> int:
    """Sandboxes booting at once on this host: four per core.

    A boot mostly waits (runsc's processes hand each other fds and syncs, the agent's imports
    go through the Gofer): 30 gvisor creates through this semaphore on 2 cores at load ~55 were
    all interactive in 74 s with 2 at once and 26 s with 8 (p50 47 s and 17 s)."""
    return BOOTS_PER_CORE * (os.cpu_count() or 1)


class WarmPool:
    def __init__(
        self,
        driver: SandboxDriver,
        size: int,
        limits: Limits,
        boots: asyncio.Semaphore | None = None,
    ) -> None:
        if size < 0:
            raise errors.InvalidRequest.field("pool_size", "must be >= 0")
        self.driver = driver
        self.size = size
        self.limits = limits
        self._boots = boots
        self._ready: list[Sandbox] = []
        self._wake = asyncio.Event()
        self._full = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.last_error: str | None = None

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    async def start(self) -> None:
        if self._task is None and self.size > 0:
            self._task = asyncio.create_task(self._fill_loop(), name="warm-pool")

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the pool is full (for benchmarks and tests)."""
        async with asyncio.timeout(timeout):
            await self._full.wait()

    async def acquire(self, owner: str, limits: Limits | None = None) -> Sandbox:
        """A warm sandbox (its lifetime restarted as ``limits`` say), else a cold one."""
        if self._closed:
            raise errors.SandboxError("warm pool is closed")
        warm = await self._take_ready(owner, limits)
        if warm is not None:
            return warm
        self._wake.set()
        async with self.boots:
            # The refill may have finished one while this caller waited for its turn.
            warm = await self._take_ready(owner, limits)
            if warm is not None:
                return warm
            return await self.driver.create(owner=owner, limits=limits or self.limits)

    @property
    def boots(self) -> asyncio.Semaphore:
        if self._boots is None:  # made on first use: it belongs to the loop that awaits it
            self._boots = asyncio.Semaphore(boots_at_once())
        return self._boots

    async def _take_ready(self, owner: str, limits: Limits | None) -> Sandbox | None:
        while self._ready:
            sbx = self._ready.pop(0)
            self._full.clear()
            self._wake.set()
            if not sbx.alive:
                continue
            await sbx.adopt(owner, None if limits is None else limits.lifetime_seconds)
            return sbx
        return None

    async def _fill_loop(self) -> None:
        backoff = 0.5
        while not self._closed:
            self._ready = [s for s in self._ready if s.alive]
            if len(self._ready) < self.size:
                self._full.clear()
            if len(self._ready) < self.size:
                try:
                    async with self.boots:
                        sbx = await self.driver.create(owner=POOL_OWNER, limits=self.limits)
                except errors.EphemeralError as exc:
                    self.last_error = str(exc)
                    log.warning("warm pool: create failed: %s", exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
                    continue
                backoff = 0.5
                if self._closed:
                    await sbx.destroy()
                    return
                self._ready.append(sbx)
                continue
            self._full.set()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), CHECK_SECONDS)

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        ready, self._ready = self._ready, []
        await asyncio.gather(*(s.destroy() for s in ready), return_exceptions=True)
