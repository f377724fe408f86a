"""An HTTP proxy in front of a real Prefect server that fails a fraction of API calls.

Each request is forwarded on a fresh upstream connection (one request per client connection:
the answer carries ``Connection: close``), unless the dice say to answer ``503`` or to drop
the connection without an answer. WebSocket upgrades (Prefect's event stream) are tunnelled
untouched. Runs its own event loop in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from dataclasses import dataclass, field

HEAD_LIMIT = 64 * 1024
UNAVAILABLE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"content-length: 2\r\nconnection: close\r\n\r\n{}"
)


@dataclass
class FaultProxy:
    upstream_port: int
    p_unavailable: float = 0.1
    p_drop: float = 0.05
    seed: int = 12
    port: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "503": 0, "drop": 0, "ws": 0})

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def calm(self) -> None:
        """No more faults from now on."""
        self.p_unavailable = self.p_drop = 0.0

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def listen() -> None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()

        self._loop.run_until_complete(listen())
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if len(head) > HEAD_LIMIT:
                return
            lines = head.decode("latin-1").split("\r\n")
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in lines[1:] if line)
            }
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            try:
                if "upgrade" in headers.get("connection", "").lower():
                    self.counts["ws"] += 1
                    up_writer.write(head)
                    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
                    return
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                dice = self._rng.random()
                if dice < self.p_drop:
                    self.counts["drop"] += 1
                    return  # closed without an answer
                if dice < self.p_drop + self.p_unavailable:
                    self.counts["503"] += 1
                    writer.write(UNAVAILABLE)
                    await writer.drain()
                    return
                self.counts["ok"] += 1
                kept = [
                    line
                    for line in lines[1:]
                    if line and line.split(":", 1)[0].strip().lower() != "connection"
                ]
                request = "\r\n".join([lines[0], *kept, "Connection: close", "", ""])
                up_writer.write(request.encode("latin-1") + body)
                await up_writer.drain()
                await _pipe(up_reader, writer)
            finally:
                up_writer.close()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError):
                writer.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while chunk := await src.read(65536):
            dst.write(chunk)
            await dst.drain()
    with contextlib.suppress(OSError, RuntimeError):
        if dst.can_write_eof():
            dst.write_eof()
