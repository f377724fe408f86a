"""The internal channel through the in-memory transport (``ephemeral.testing.hostlink``): the
same signed calls, refusals and errors as over TCP (tests/hostlink/test_hostlink.py), with no
socket, so that placement can be tested without one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from ephemeral import errors
from ephemeral.sessions.link import LinkClient, LinkError, LinkRefused, LinkServer, Peer
from ephemeral.testing.hostlink import MemoryTransport
from tests.hostlink.listener import KEY
from tests.hostlink.test_hostlink import Recorder, request, signed_frame


@pytest.fixture
async def served() -> AsyncIterator[tuple[MemoryTransport, LinkServer, Recorder, Peer]]:
    handler = Recorder()
    server = LinkServer(KEY, "a", handler)
    memory = MemoryTransport()
    address = await memory.listen(server)
    try:
        yield memory, server, handler, Peer("a", address, server.instance)
    finally:
        await server.close()


async def test_a_signed_call_round_trips_in_memory(served: Any) -> None:
    memory, _, handler, peer = served
    client = LinkClient(KEY, "api", memory)
    result, body = await client.call(peer, "exec", {"x": 1}, b"abc", timeout=10)
    with pytest.raises(errors.FileNotFound, match="no such file"):
        await client.call(peer, "missing", {}, timeout=10)
    assert result == {"echo": {"x": 1}} and body == b"cba"
    assert [c[0] for c in handler.calls] == ["exec", "missing"] and memory.frames == 2


async def test_in_memory_the_server_still_judges_every_request(served: Any) -> None:
    memory, server, handler, peer = served
    with pytest.raises(LinkRefused, match="bad signature"):
        await LinkClient(b"x" * 32, "api", memory).call(peer, "exec", {}, timeout=10)
    stale = Peer(peer.host, peer.address, "0" * 32)  # an earlier process of the host
    with pytest.raises(LinkRefused, match="another host or an earlier process"):
        await LinkClient(KEY, "api", memory).call(stale, "exec", {}, timeout=10)
    frame = signed_frame(request(peer), b"body")
    assert b'"re"' in await server.exchange(frame)  # answered, signed over its nonce
    assert b'"refused":"replayed"' in await server.exchange(frame)
    tampered = signed_frame(request(peer), b"body")[:-4] + b"BODY"
    assert b"does not match its signed hash" in await server.exchange(tampered)
    assert len(handler.calls) == 1  # only the one authentic, fresh request ran


async def test_a_closed_or_unknown_host_is_unreachable(served: Any) -> None:
    memory, server, _, peer = served
    client = LinkClient(KEY, "api", memory)
    with pytest.raises(LinkError, match="unreachable"):
        await client.call(Peer("b", "127.0.0.1:9", "0" * 32), "exec", {}, timeout=10)
    await server.close()
    with pytest.raises(LinkError, match="unreachable"):
        await client.call(peer, "exec", {}, timeout=10)
