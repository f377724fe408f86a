"""The internal channel's security claims (docs/security.md, "The internal channel"): both ends
authenticate, a request is good once, for one host process, within the time window, and the
listener binds only loopback or private addresses. Real sockets on 127.0.0.1, no sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from ephemeral import errors
from ephemeral.sessions import link as hostlink
from ephemeral.sessions.link import LinkClient, LinkError, LinkRefused, LinkServer, Peer
from ephemeral.settings import Settings
from tests.hostlink import listener
from tests.hostlink.listener import KEY, spawn

REPO = Path(__file__).resolve().parents[2]


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any], bytes]] = []

    async def __call__(
        self, op: str, args: dict[str, Any], body: bytes
    ) -> tuple[dict[str, Any], bytes]:
        self.calls.append((op, args, body))
        if op == "missing":
            raise errors.FileNotFound("/nope: no such file")
        return {"echo": args}, body[::-1]


@pytest.fixture
async def served() -> AsyncIterator[tuple[LinkServer, Recorder, Peer]]:
    handler = Recorder()
    server = LinkServer(KEY, "a", handler)
    address = await server.start("127.0.0.1")
    try:
        yield server, handler, Peer("a", address, server.instance)
    finally:
        await server.close()


async def raw(peer: Peer, data: bytes) -> dict[str, Any]:
    """Send bytes as they are; the first frame header that comes back."""
    host, _, port = peer.address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        (size,) = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), 10))
        return dict(json.loads(await reader.readexactly(size)))
    finally:
        writer.close()


def signed_frame(header: dict[str, Any], body: bytes, key: bytes = KEY) -> bytes:
    header = {**header, "body_len": len(body), "body_sha256": hostlink._sha(body)}
    header["sig"] = hostlink._sign(key, hostlink._REQ, header)
    return hostlink._frame(header, body)


def request(peer: Peer, **over: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "op": "exec",
        "args": {"session_id": "s"},
        "from": "api",
        "to": peer.host,
        "instance": peer.instance,
        "ts": time.time(),
        "nonce": os.urandom(16).hex(),
        **over,
    }


async def test_a_signed_call_round_trips_with_its_body(served: Any) -> None:
    _, handler, peer = served
    client = LinkClient(KEY, "api")
    try:
        result, body = await client.call(peer, "exec", {"x": 1}, b"abc", timeout=10)
        again, _ = await client.call(peer, "exec", {"x": 2}, b"", timeout=10)  # pooled connection
    finally:
        await client.close()
    assert result == {"echo": {"x": 1}} and body == b"cba"
    assert again == {"echo": {"x": 2}}
    assert [c[0] for c in handler.calls] == ["exec", "exec"]


async def test_a_problem_on_the_host_is_the_same_error_here(served: Any) -> None:
    _, _, peer = served
    client = LinkClient(KEY, "api")
    try:
        with pytest.raises(errors.FileNotFound, match="no such file"):
            await client.call(peer, "missing", {}, timeout=10)
    finally:
        await client.close()


async def test_a_wrong_key_is_refused_and_nothing_runs(served: Any) -> None:
    _, handler, peer = served
    client = LinkClient(b"x" * 32, "api")
    try:
        with pytest.raises(LinkRefused, match="bad signature"):
            await client.call(peer, "exec", {}, timeout=10)
    finally:
        await client.close()
    assert handler.calls == []


async def test_unsigned_tampered_replayed_stale_and_misaddressed_requests_are_refused(
    served: Any,
) -> None:
    _, handler, peer = served
    unsigned = request(peer)
    unsigned.update(body_len=0, body_sha256=hostlink._sha(b""))
    assert (await raw(peer, hostlink._frame(unsigned, b"")))["refused"] == "bad signature"

    # a valid request is answered once; the same bytes again are a replay
    good = signed_frame(request(peer), b"body")
    first = await raw(peer, good)
    assert first["status"] == 200 and "refused" not in first
    assert (await raw(peer, good))["refused"] == "replayed"

    # the body swapped under a signed header
    frame = signed_frame(request(peer), b"body")
    assert (await raw(peer, frame[: -len(b"body")] + b"evil"))["refused"].startswith("the body")

    # an argument changed after signing
    header = request(peer)
    header.update(body_len=0, body_sha256=hostlink._sha(b""))
    header["sig"] = hostlink._sign(KEY, hostlink._REQ, header)
    header["args"] = {"session_id": "other"}
    assert (await raw(peer, hostlink._frame(header, b"")))["refused"] == "bad signature"

    stale = signed_frame(request(peer, ts=time.time() - hostlink.SKEW_SECONDS - 5), b"")
    assert (await raw(peer, stale))["refused"] == "outside the time window"
    for wrong in ({"to": "b"}, {"instance": "0" * 32}):  # another host, an earlier process
        frame = signed_frame(request(peer, **wrong), b"")
        assert (await raw(peer, frame))["refused"].startswith("addressed to another host")
    # a response signature is not a request signature (domain separation)
    header = request(peer)
    header.update(body_len=0, body_sha256=hostlink._sha(b""))
    header["sig"] = hostlink._sign(KEY, hostlink._RESP, header)
    assert (await raw(peer, hostlink._frame(header, b"")))["refused"] == "bad signature"
    # a huge header length is refused without reading it
    assert "cap" in (await raw(peer, struct.pack(">I", 1 << 30)))["refused"]
    assert len(handler.calls) == 1  # only the one good request ran


async def test_the_client_refuses_an_answer_not_signed_by_the_host() -> None:
    """Mutual: a process on the host's port without the key cannot answer for it."""
    impostor = LinkServer(b"y" * 32, "a", Recorder())
    address = await impostor.start("127.0.0.1")
    # the impostor accepts anything: make it skip its own check
    impostor._fresh = lambda header: None  # type: ignore[method-assign]
    client = LinkClient(KEY, "api")
    try:
        with pytest.raises(LinkError, match="without a valid signature"):
            await client.call(Peer("a", address, impostor.instance), "exec", {}, timeout=10)
    finally:
        await client.close()
        await impostor.close()


async def test_a_host_that_is_gone_is_an_error_at_once_not_a_hang(served: Any) -> None:
    server, _, peer = served
    await server.close()
    client = LinkClient(KEY, "api")
    t0 = time.monotonic()
    # "unreachable" is the refused connection; a call that waited out its timeout says "did
    # not answer within 30 s" instead: the message, not a time, tells the two apart
    with pytest.raises(LinkError, match="unreachable"):
        await client.call(peer, "exec", {}, timeout=30)
    print(f"refused in {time.monotonic() - t0:.3f} s")
    await client.close()


@pytest.mark.parametrize(
    "address",
    ["0.0.0.0", "::", "8.8.8.8", "203.0.113.7", "2001:4860::1", "169.254.169.254", "localhost"],
)
def test_a_public_wildcard_or_named_address_is_refused(address: str) -> None:
    with pytest.raises(errors.InvalidRequest, match="EPHEMERAL_LINK_ADDRESS"):
        hostlink.check_bind_address(address)


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "10.1.2.3", "192.168.0.4", "fd00::5"])
def test_loopback_and_private_addresses_are_allowed(address: str) -> None:
    assert hostlink.check_bind_address(address)


async def test_the_client_will_not_connect_to_a_public_address() -> None:
    client = LinkClient(KEY, "api")
    with pytest.raises(LinkError, match="will not connect"):
        await client.call(Peer("a", "8.8.8.8:4000", "i"), "exec", {}, timeout=5)


def test_ephemeral_worker_refuses_to_start_on_a_public_address(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "EPHEMERAL_STATE_DIR": str(tmp_path / "state"),
        "EPHEMERAL_LINK_ADDRESS": "0.0.0.0",
        "PREFECT_API_URL": "http://127.0.0.1:9/api",
    }
    res = subprocess.run(
        [sys.executable, "-m", "ephemeral.cli", "worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode != 0
    assert "EPHEMERAL_LINK_ADDRESS" in res.stderr + res.stdout, res.stderr


# abuse: what a peer without the key can make the listener hold (docs/security.md) -----------


@contextlib.asynccontextmanager
async def limited(limits: hostlink.Limits) -> AsyncIterator[tuple[LinkServer, Peer]]:
    server = LinkServer(KEY, "a", Recorder(), limits)
    address = await server.start("127.0.0.1")
    try:
        yield server, Peer("a", address, server.instance)
    finally:
        await server.close()


async def connect(peer: Peer, source: str = "127.0.0.1") -> tuple[Any, Any]:
    host, _, port = peer.address.rpartition(":")
    return await asyncio.open_connection(host, int(port), local_addr=(source, 0))


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """True once the server closed or reset the connection (within 10 s; False if not)."""
    try:
        return await asyncio.wait_for(reader.read(1), 10) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


async def answered(peer: Peer, reader: Any, writer: Any) -> bool:
    """A signed request on this open connection is answered (not refused, not closed)."""
    writer.write(signed_frame(request(peer, op="ping"), b""))
    await writer.drain()
    (size,) = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), 10))
    return json.loads(await reader.readexactly(size)).get("status") == 200


NESTED = [
    b"[" * 60_000,  # never closed
    b"[" * 30_000 + b"]" * 30_000,
    b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
    b"[{" * 15_000 + b"}]" * 15_000,
    b"[" * 33 + b"]" * 33,  # one level past the bound
    b"[" + b"[1]," * 600 + b"1]",  # two levels, but 1,202 brackets
]


@pytest.mark.parametrize("header", NESTED, ids=["open", "arrays", "objects", "mixed", "33", "wide"])
async def test_a_deeply_nested_header_is_refused_cleanly_without_a_traceback(
    served: Any, header: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    _, handler, peer = served
    answer = await raw(peer, struct.pack(">I", len(header)) + header)
    assert "nested deeper than 32" in answer["refused"]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert handler.calls == []


async def test_brackets_in_strings_and_32_levels_are_not_too_deep(served: Any) -> None:
    _, _, peer = served
    deep: Any = 1
    for _ in range(30):  # the header object and "args" make 32
        deep = [deep]
    header = request(peer, args={"path": "[[[{{{" * 5000 + '\\"[['}, deep=deep)
    header.update(body_len=0, body_sha256=hostlink._sha(b""))
    answer = await raw(peer, hostlink._frame(header, b""))
    assert answer["refused"] == "bad signature"  # parsed, then judged as a request


async def test_a_connection_that_does_not_authenticate_in_time_is_closed() -> None:
    async with limited(hostlink.Limits(auth_seconds=0.5)) as (server, peer):
        silent, _ = await connect(peer)
        loris, writer = await connect(peer)
        writer.write(struct.pack(">I", 1000) + b'{"v":1,')  # the rest never comes
        assert await closed_by_server(silent)
        assert await closed_by_server(loris)
        assert server.connections == 0
        assert server.refused["no request within 0.5 s"] == 2


async def test_past_the_per_peer_cap_that_peers_oldest_unauthenticated_connection_gives_way() -> (
    None
):
    async with limited(hostlink.Limits(unauthenticated_per_peer=4)) as (server, peer):
        other = [await connect(peer, "127.0.0.2") for _ in range(4)]
        flood = [await connect(peer) for _ in range(12)]
        # 127.0.0.1's oldest eight gave way to its newest four; 127.0.0.2's four are untouched
        assert all([await closed_by_server(r) for r, _ in flood[:8]])
        assert all([await answered(peer, r, w) for r, w in flood[8:]])
        assert all([await answered(peer, r, w) for r, w in other])
        assert server.refused["over the per-peer cap"] == 8


async def test_at_the_cap_an_unauthenticated_connection_gives_way_else_the_new_one_is_reset() -> (
    None
):
    async with limited(hostlink.Limits(connections=3)) as (server, peer):
        trusted = [await connect(peer) for _ in range(2)]
        assert all([await answered(peer, r, w) for r, w in trusted])
        silent, _ = await connect(peer, "127.0.0.2")
        newer, writer = await connect(peer, "127.0.0.3")
        assert await closed_by_server(silent)  # gave way to the newer one
        assert await answered(peer, newer, writer)
        # all three authenticated: a fourth is reset as it is accepted
        try:
            refused, _ = await connect(peer, "127.0.0.4")
        except ConnectionResetError:
            pass  # reset before the connect call returned
        else:
            assert await closed_by_server(refused)
        assert server.refused["at the connection cap"] == 2
        assert server.connections == 3
        assert all([await answered(peer, r, w) for r, w in [*trusted, (newer, writer)]])


async def test_a_flood_of_unauthenticated_connections_leaves_authenticated_calls_answering(
    tmp_path: Path,
) -> None:
    """The red team's flood (12,223 connections drove the listener to 11,831 descriptors and
    821 MiB; a nested header logged a RecursionError traceback each): up to 20,000 connections
    without the key from 40 loopback addresses (the API's own among them), some with a nested
    header or a slow one, against a listener in its own process at the default caps. Fresh and
    pooled authenticated calls keep answering within the client's usual timeout, the
    listener's descriptors stay under the cap, and nothing it logged is a traceback."""
    cap = Settings().link_max_connections
    with (tmp_path / "listener.log").open("w") as log:
        host = spawn("tests.hostlink.listener", stderr=log)
    assert host.stdout is not None
    try:
        info = json.loads(await asyncio.to_thread(host.stdout.readline))
        peer = Peer(listener.HOST, info["address"], info["instance"])
        fds = Path(f"/proc/{info['pid']}/fd")
        pooled = LinkClient(KEY, "api")  # a connection an API process already holds
        await pooled.call(peer, "ping", {}, timeout=10)
        flood = spawn("tests.hostlink.flood", info["address"], "--connections", "20000")
        assert flood.stdout is not None
        try:
            wave = asyncio.ensure_future(asyncio.to_thread(flood.stdout.readline))
            calls, most_fds = 0, 0
            while not wave.done() or calls < 10:
                fresh = LinkClient(KEY, "api")  # a new connection, through the flood
                try:
                    assert (await fresh.call(peer, "ping", {}, timeout=10))[0] == {"op": "ping"}
                finally:
                    await fresh.close()
                assert (await pooled.call(peer, "ping", {}, timeout=10))[0] == {"op": "ping"}
                most_fds = max(most_fds, len(os.listdir(fds)))
                calls += 1
            opened = int((await wave).split()[-1])
            deep = NESTED[1]
            assert (
                "nested deeper" in (await raw(peer, struct.pack(">I", len(deep)) + deep))["refused"]
            )
            stats, _ = await pooled.call(peer, "stats", {}, timeout=10)
        finally:
            await pooled.close()
            flood.stdin.close()  # type: ignore[union-attr]
            flood.wait(60)
    finally:
        host.stdin.close()  # type: ignore[union-attr]
        host.wait(60)
    logged = (tmp_path / "listener.log").read_text()
    assert opened > 2 * cap, f"the flood opened only {opened} connections"
    assert max(most_fds, stats["fds"]) <= cap + 16, (most_fds, stats)
    assert stats["refused"]["at the connection cap"] > cap  # the cap held, and gave way
    assert "Traceback" not in logged and "RecursionError" not in logged, logged[-2000:]
