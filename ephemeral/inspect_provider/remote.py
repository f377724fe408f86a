"""The provider's backend when ``EPHEMERAL_URL`` is set: the server's ``/v1/sandboxes`` API."""

from __future__ import annotations

import secrets

from ephemeral import errors
from ephemeral.client import AsyncClient
from ephemeral.lifecycle import RunStatus
from ephemeral.sandbox.base import ExecResult
from ephemeral.sessions.requests import ExecRequest, SessionRequest
from ephemeral.settings import Settings

# stdin past this goes up as a file first (a JSON body is capped at ~11 MB on the server)
INLINE_STDIN = 4 << 20


class RemoteBackend:
    def __init__(self, settings: Settings) -> None:
        self.client = AsyncClient(settings)

    async def create(self, request: SessionRequest) -> str:
        obj = await self.client.sandboxes.create(**request.model_dump(mode="json"))
        if obj.get("status") != RunStatus.RUNNING:
            term = obj.get("termination") or {}
            raise errors.SandboxError(
                f"the sandbox did not start: {term.get('reason')}: {term.get('detail')}"
            )
        return str(obj["id"])

    async def exec(self, session_id: str, request: ExecRequest) -> ExecResult:
        fields = request.model_dump(mode="json", exclude={"command", "stdin_base64"})
        stdin = request.stdin()
        spill = None
        if len(stdin) > INLINE_STDIN:
            spill = f"/tmp/.ephemeral-stdin-{secrets.token_hex(8)}"
            await self.client.sandboxes.write_file(session_id, spill, stdin)
            fields["stdin_path"] = spill
        elif stdin:
            fields["stdin"] = stdin
        try:
            out = await self.client.sandboxes.exec(session_id, request.command, **fields)
        finally:
            if spill is not None:
                await self.client.sandboxes.exec(session_id, ["rm", "-f", "--", spill], cwd="/")
        return ExecResult.model_validate(out)

    async def write(self, session_id: str, path: str, data: bytes) -> None:
        await self.client.sandboxes.write_file(session_id, path, data)

    async def read(self, session_id: str, path: str, max_bytes: int) -> bytes:
        return await self.client.sandboxes.read_file(session_id, path, max_bytes)

    async def end(self, session_id: str) -> None:
        await self.client.sandboxes.delete(session_id)

    async def close(self) -> None:
        await self.client.aclose()
