"""What every sandbox shares however it runs: adopt, expiry and destroy-once.

A driver's sandbox subclasses :class:`SandboxBase` and supplies only ``_running`` (is its
runtime still up?) and ``_teardown`` (kill and free what it started). The base owns the rest of
the lifecycle, so the rules hold for every level alike:

- ``destroy`` runs ``_teardown`` exactly once, however many callers (the lifetime timer, a
  broken guest, the run's teardown, ``async with``) race to it; then removes the handle file.
- the wall-clock lifetime (``limits.lifetime_seconds``) starts when the sandbox is ready and
  restarts when the warm pool hands it to its real owner (``adopt``), which also re-owns the
  handle so the reaper attributes it correctly after a crash.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import TracebackType
from typing import Self

from ephemeral.sandbox import handles
from ephemeral.sandbox.base import Handle, Limits


class SandboxBase:
    def __init__(
        self,
        *,
        sandbox_id: str,
        isolation: str,
        image: str,
        runtime: str,
        owner: str,
        limits: Limits,
        handle: Handle | None = None,
        handle_file: Path | None = None,
    ) -> None:
        self.id = sandbox_id
        self.isolation = isolation
        self.image = image
        self.runtime = runtime  # the runtime's version line
        self.owner = owner
        self.limits = limits
        self.boot_ms = 0
        self.workdir = ""
        self._handle = handle
        self._handle_file = handle_file
        self._destroyed = False
        self._destroy_lock = asyncio.Lock()
        self._lifetime_task: asyncio.Task[None] | None = None

    # ---- what a driver's sandbox supplies

    def _running(self) -> bool:
        """Whether the runtime is up and its agent answered (False before start)."""
        return True

    async def _teardown(self) -> None:
        """Kill and free everything this sandbox started; called once, by ``destroy``."""

    # ---- the lifecycle

    @property
    def alive(self) -> bool:
        return not self._destroyed and self._running()

    def _start_lifetime(self) -> None:
        """(Re)start the wall-clock lifetime; on expiry the sandbox destroys itself."""
        if self._lifetime_task is not None:
            self._lifetime_task.cancel()
        self._lifetime_task = asyncio.create_task(
            self._expire(self.limits.lifetime_seconds), name=f"lifetime-{self.id}"
        )

    async def _expire(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await self.destroy()

    async def adopt(self, owner: str, lifetime_seconds: float | None = None) -> None:
        """``owner`` adopts a warm sandbox: re-own its handle and restart its lifetime.

        ``lifetime_seconds`` is the owner's (a run or session longer than the pool's default
        must not lose its sandbox at the pool's lifetime)."""
        self.owner = owner
        if lifetime_seconds is not None:
            self.limits = self.limits.model_copy(update={"lifetime_seconds": lifetime_seconds})
        if self._handle is not None and self._handle_file is not None:
            self._handle.owner = owner
            await asyncio.to_thread(handles.write, self._handle_file.parent, self._handle)
        self._start_lifetime()

    async def destroy(self) -> None:
        """Idempotent; afterwards no process, mount, cgroup or file of the sandbox remains."""
        async with self._destroy_lock:
            if self._destroyed:
                return
            self._destroyed = True
            task = self._lifetime_task
            if task is not None and task is not asyncio.current_task():
                task.cancel()
            await self._teardown()
            if self._handle is not None and self._handle_file is not None:
                await asyncio.to_thread(handles.teardown, self._handle, self._handle_file)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.destroy()
