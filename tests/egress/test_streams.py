"""The host side of the stream protocol against a lying guest: every frame it did not expect
breaks the client (the sandbox is then destroyed); honest frames flow within the windows."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest

from ephemeral import errors
from ephemeral.sandbox import protocol as p
from ephemeral.sandbox.guest import GuestClient
from ephemeral.sandbox.streams import STREAM_FRAME_CAP, GuestStream


class Wire:
    """What the host wrote (decoded frames)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def frames(self) -> list[dict[str, Any]]:
        """JSON frames as they are; a binary data frame as {"s", "t": "bin", "raw"}."""
        out, buf = [], bytes(self.data)
        while buf:
            n = int.from_bytes(buf[:4], "big")
            if n & p.BINARY:
                n &= ~p.BINARY
                sid = int.from_bytes(buf[4:8], "big")
                out.append({"s": sid, "t": "bin", "raw": buf[8 : 4 + n]})
            else:
                out.append(json.loads(buf[4 : 4 + n]))
            buf = buf[4 + n :]
        return out


def frame(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj).encode()
    return len(body).to_bytes(4, "big") + body


def data(sid: int, raw: bytes) -> bytes:
    return frame({"s": sid, "t": "data", "d": base64.b64encode(raw).decode()})


def binary(sid: int, raw: bytes, size: int | None = None) -> bytes:
    n = len(raw) + 4 if size is None else size
    return (n | p.BINARY).to_bytes(4, "big") + sid.to_bytes(4, "big") + raw


async def started(
    reader: asyncio.StreamReader, wire: Wire, accepted: list[GuestStream], window: int = 1024
) -> GuestClient:
    client = GuestClient(reader, wire, op_timeout=2.0)

    async def accept(stream: GuestStream) -> None:
        accepted.append(stream)
        await asyncio.sleep(3600)

    task = asyncio.create_task(client.start_egress(accept, port=3128, max_streams=2, window=window))
    await asyncio.sleep(0.01)
    req = wire.frames()[0]
    assert req["op"] == "egress" and len(req["id"]) == 32
    reader.feed_data(frame({"id": req["id"], "ok": True, "port": 3128}))
    await task
    return client


async def broken_by(chunks: list[bytes], window: int = 1024) -> str:
    reader, wire, accepted = asyncio.StreamReader(), Wire(), []
    client = await started(reader, wire, accepted, window)
    for chunk in chunks:
        reader.feed_data(chunk)
    for _ in range(50):
        await asyncio.sleep(0.01)
        if client.broken:
            break
    assert client.broken
    with pytest.raises(errors.SandboxError) as info:
        await client.ping()
    return info.value.detail


async def test_honest_streams_flow_within_the_windows() -> None:
    reader, wire, accepted = asyncio.StreamReader(), Wire(), []
    client = await started(reader, wire, accepted)
    reader.feed_data(frame({"s": 1, "t": "open"}) + data(1, b"GET / HTTP/1.1\r\n\r\n"))
    await asyncio.sleep(0.01)
    (stream,) = accepted
    assert await stream.read() == b"GET / HTTP/1.1\r\n\r\n"
    reader.feed_data(binary(1, b"more") + binary(1, b" bytes"))
    await asyncio.sleep(0.01)
    assert await stream.read() == b"more bytes"
    acks = [f["n"] for f in wire.frames() if f.get("t") == "ack"]
    assert acks == [18, 10]
    writer = asyncio.create_task(stream.write(b"x" * 1500))  # more than one window
    await asyncio.sleep(0.01)
    sent = [f for f in wire.frames() if f.get("t") == "bin"]
    assert sum(len(f["raw"]) for f in sent) == 1024 and not writer.done()
    reader.feed_data(frame({"s": 1, "t": "ack", "n": 1024}))
    await asyncio.wait_for(writer, 1)
    # a reply still finds its request while streams are open
    ping = asyncio.create_task(client.ping())
    await asyncio.sleep(0.01)
    rid = next(f["id"] for f in wire.frames() if f.get("op") == "ping")
    reader.feed_data(frame({"s": 1, "t": "eof"}) + frame({"id": rid, "ok": True}))
    await asyncio.wait_for(ping, 1)
    assert await stream.read() == b"" and stream.eof
    reader.feed_data(frame({"s": 1, "t": "close"}))
    await asyncio.sleep(0.01)
    assert stream.closed and {"s": 1, "t": "close"} in wire.frames()
    # frames that crossed our close are dropped, not fatal
    reader.feed_data(data(1, b"late") + frame({"s": 1, "t": "close"}))
    await asyncio.sleep(0.01)
    assert not client.broken


@pytest.mark.parametrize(
    ("chunks", "why"),
    [
        ([frame({"s": 2, "t": "open"})], "opened stream 2, expected 1"),
        ([frame({"s": 1, "t": "open"}), frame({"s": 1, "t": "open"})], "expected 2"),
        (
            [frame({"s": i, "t": "open"}) for i in (1, 2, 3)],
            "more than 2 streams",
        ),
        ([data(1, b"x")], "never opened"),
        ([frame({"s": 1, "t": "open"}), data(1, b"x" * 1025)], "overran the window"),
        (
            [frame({"s": 1, "t": "open"}), data(1, b"x" * 1000), data(1, b"x" * 100)],
            "overran the window",
        ),
        ([frame({"s": 1, "t": "open"}), frame({"s": 1, "t": "ack", "n": 1})], "never sent"),
        (
            [frame({"s": 1, "t": "open"}), frame({"s": 1, "t": "eof"}), data(1, b"x")],
            "after its end",
        ),
        ([frame({"s": 1, "t": "open", "x": 1})], "invalid stream frame"),
        ([frame({"s": 0, "t": "open"})], "invalid stream frame"),
        ([frame({"s": 1, "t": "shout"})], "invalid stream frame"),
        ([frame({"id": "0" * 32, "ok": True})], "not in flight"),
        ([(STREAM_FRAME_CAP + 1).to_bytes(4, "big")], "frame (cap"),
        ([frame({"s": 1, "t": "open"}), frame({"s": 1, "t": "data", "d": "!!"})], "base64"),
        ([binary(1, b"x")], "never opened"),
        ([frame({"s": 1, "t": "open"}), binary(0, b"x")], "stream 0 it never opened"),
        ([frame({"s": 1, "t": "open"}), binary(1, b"")], "4-byte data frame"),
        ([frame({"s": 1, "t": "open"}), binary(1, b"x" * 1025)], "overran the window"),
        ([(p.BINARY | (p.STREAM_CHUNK + 5)).to_bytes(4, "big")], "data frame"),
        (
            [frame({"s": 1, "t": "open"}), frame({"s": 1, "t": "eof"}), binary(1, b"x")],
            "after its end",
        ),
    ],
)
async def test_a_lying_guest_breaks_the_client(chunks: list[bytes], why: str) -> None:
    assert why in await broken_by(chunks)


async def test_egress_cannot_start_twice_and_the_ports_must_match() -> None:
    reader, wire, accepted = asyncio.StreamReader(), Wire(), []
    client = await started(reader, wire, accepted)
    with pytest.raises(errors.SandboxError, match="already on"):
        await client.start_egress(lambda s: asyncio.sleep(0), port=1, max_streams=1, window=1)
    assert p.EgressRequest(id="0" * 32, port=3128, max_streams=1, window=1).op == "egress"
