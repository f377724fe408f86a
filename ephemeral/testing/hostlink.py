"""The internal channel without sockets: :class:`MemoryTransport` hands each signed request
frame to a :class:`~ephemeral.sessions.link.LinkServer` of this process (in the manner of httpx's
``MockTransport``). Signing, freshness, replay, the handler and the answer's checks are the
real ones; only TCP is left out (tests/hostlink covers it, with real sockets)."""

from __future__ import annotations

from typing import Any

from ephemeral.sessions.link import Expect, LinkServer, split_frame


class MemoryTransport:
    def __init__(self) -> None:
        self.servers: dict[str, LinkServer] = {}
        self.frames = 0  # request frames carried
        self._next = 0

    async def listen(self, server: LinkServer) -> str:
        """Serve ``server`` at a new loopback address of this transport (what a
        :class:`~ephemeral.sessions.host.SessionHost` is given instead of a socket)."""
        self._next += 1
        server.address = f"127.0.0.1:{self._next}"
        self.servers[server.address] = server
        return server.address

    async def exchange(
        self, address: str, frame: bytes, expect: Expect
    ) -> tuple[dict[str, Any], bytes]:
        server = self.servers.get(address)
        if server is None or server.closed:
            raise ConnectionRefusedError(f"nothing serves {address}")
        self.frames += 1
        resp, out = split_frame(await server.exchange(frame))
        expect.header(resp)
        expect.body(resp, out)
        return resp, out

    def forget(self, address: str) -> None:
        pass  # nothing pooled

    async def close(self) -> None:
        pass
