"""A tiny QMP (QEMU Machine Protocol) client over a unix socket.

Only what the microVM driver needs: the capabilities handshake, ``execute`` with a deadline,
and waiting for a migration to finish. QEMU is trusted less than us but more than the guest:
replies are still size-capped and every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

from ephemeral.errors import SandboxError

MAX_LINE = 1 << 20


class QMPClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def connect(cls, path: Path, *, timeout: float = 5.0) -> QMPClient:
        """Connect (retrying while QEMU creates the socket) and negotiate capabilities."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(path), limit=MAX_LINE)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if loop.time() > deadline:
                    raise SandboxError(f"QMP socket {path} not ready: {exc}") from exc
                await asyncio.sleep(0.02)
        client = cls(reader, writer)
        try:
            greeting = await client._read(deadline - loop.time())
            if "QMP" not in greeting:
                raise SandboxError(f"QMP: unexpected greeting {str(greeting)[:200]}")
            await client.execute("qmp_capabilities", timeout=max(0.1, deadline - loop.time()))
        except BaseException:
            await client.close()
            raise
        return client

    async def _read(self, timeout: float) -> dict[str, Any]:
        try:
            async with asyncio.timeout(max(0.01, timeout)):
                line = await self._reader.readline()
        except TimeoutError:
            raise SandboxError(f"QMP: no reply within {timeout:.1f}s") from None
        except (ValueError, asyncio.LimitOverrunError) as exc:
            raise SandboxError("QMP: reply line too long") from exc
        if not line:
            raise SandboxError("QMP: QEMU closed the monitor")
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise SandboxError("QMP: reply is not JSON") from exc
        if not isinstance(obj, dict):
            raise SandboxError("QMP: reply is not an object")
        return obj

    async def execute(self, command: str, *, timeout: float = 10.0, **arguments: Any) -> Any:
        """Run one command and return its ``return`` value; QMP errors become SandboxError."""
        msg: dict[str, Any] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        self._writer.write(json.dumps(msg).encode() + b"\n")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self._writer.drain()
        while True:
            obj = await self._read(deadline - loop.time())
            if "event" in obj:
                self.events.append(obj)
                continue
            if "error" in obj:
                err = obj["error"]
                desc = err.get("desc", err) if isinstance(err, dict) else err
                raise SandboxError(f"QMP {command}: {desc}")
            if "return" in obj:
                return obj["return"]

    async def migrate_to_file(self, path: Path, *, timeout: float = 60.0) -> None:
        """Save the whole VM state (RAM and devices) into ``path``; the VM stays paused."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # Sharper than a shell word: the path is ours, but keep the exec: URI unambiguous.
        if any(c in str(path) for c in " '\"\\$`;&|<>\n"):
            raise SandboxError(f"snapshot path {path} has characters unsafe for exec:")
        await self.execute("migrate", uri=f"exec:cat > {path}")
        while True:
            info = await self.execute("query-migrate", timeout=max(0.1, deadline - loop.time()))
            status = info.get("status") if isinstance(info, dict) else None
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise SandboxError(f"snapshot migration {status}: {info.get('error-desc', '')}")
            if loop.time() > deadline:
                with contextlib.suppress(SandboxError):
                    await self.execute("migrate_cancel")
                raise SandboxError(f"snapshot migration still {status} after {timeout:.0f}s")
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await self._writer.wait_closed()
