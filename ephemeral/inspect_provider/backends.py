"""Where the provider's sessions live: in this process, or on a server (``EPHEMERAL_URL``).

Both raise the classes of :mod:`ephemeral.errors` (the client maps problem documents back to
them), so the provider maps one set of errors to what Inspect expects.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from ephemeral import errors
from ephemeral.lifecycle import RunStatus
from ephemeral.sandbox.base import ExecResult
from ephemeral.sessions.requests import ExecRequest, SessionRequest
from ephemeral.settings import Settings

if TYPE_CHECKING:
    from ephemeral.engine.runtime import Runtime


class Backend(Protocol):
    async def create(self, request: SessionRequest) -> str: ...

    async def exec(self, session_id: str, request: ExecRequest) -> ExecResult: ...

    async def write(self, session_id: str, path: str, data: bytes) -> None: ...

    async def read(self, session_id: str, path: str, max_bytes: int) -> bytes: ...

    async def end(self, session_id: str) -> None: ...

    async def close(self) -> None: ...


class LocalBackend:
    """A :class:`~ephemeral.engine.runtime.Runtime` in this process (no server): the local drivers,
    a warm pool for the config's isolation, the local org's play money, records on disk."""

    def __init__(self, runtime: Runtime, org_id: str) -> None:
        self.runtime = runtime
        self.org_id = org_id

    @classmethod
    async def start(cls, settings: Settings, isolation: str, pool_size: int) -> LocalBackend:
        from ephemeral.engine.runtime import Runtime
        from ephemeral.sandbox.registry import resolve_isolation

        level = await resolve_isolation(isolation, settings)
        settings = settings.model_copy(update={"isolation": level, "pool_size": pool_size})
        runtime = await Runtime.start(settings, warm_pool=pool_size > 0, recover=True)
        return cls(runtime, await runtime.local_org())

    async def create(self, request: SessionRequest) -> str:
        row, _ = await self.runtime.sessions.create(self.org_id, request)
        if row.status != RunStatus.RUNNING:
            raise errors.SandboxError(
                f"the sandbox did not start: {row.termination_reason}: {row.termination_detail}"
            )
        return row.id

    async def exec(self, session_id: str, request: ExecRequest) -> ExecResult:
        return await self.runtime.sessions.exec(session_id, self.org_id, request)

    async def write(self, session_id: str, path: str, data: bytes) -> None:
        await self.runtime.sessions.write_file(session_id, self.org_id, path, data)

    async def read(self, session_id: str, path: str, max_bytes: int) -> bytes:
        return await self.runtime.sessions.read_file(session_id, self.org_id, path, max_bytes)

    async def end(self, session_id: str) -> None:
        await self.runtime.sessions.end(session_id, self.org_id)

    async def close(self) -> None:
        await asyncio.shield(self.runtime.close())
