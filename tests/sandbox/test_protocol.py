"""The host treats the guest as hostile: every lie, flood or silence is a quick SandboxError."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.sandbox import protocol as p
from ephemeral.sandbox.guest import GuestClient
from ephemeral.sandbox.process import close_pipes

HOSTILE = Path(__file__).with_name("hostile_agent.py")
pytestmark = pytest.mark.timeout(30)


@asynccontextmanager
async def agent(mode: str) -> AsyncIterator[GuestClient]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HOSTILE),
        mode,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        yield GuestClient(proc.stdout, proc.stdin, label=mode, exec_grace=0.5, op_timeout=1.0)
    finally:
        if proc.returncode is None:
            proc.kill()
        close_pipes(proc)
        await proc.wait()


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("silent", "silent"),
        ("huge_frame", r"frame \(cap"),
        ("garbage", "not UTF-8 JSON"),
        ("not_object", "not a JSON object"),
        ("bad_hello", "invalid hello frame: workdir"),
        ("old_protocol", "protocol 99"),
        ("dies_mid_frame", "mid-frame"),
    ],
)
async def test_bad_handshakes_fail_fast(mode: str, message: str) -> None:
    async with agent(mode) as guest:
        with pytest.raises(errors.SandboxError, match=message):
            await guest.handshake(timeout=1.0)


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("mute_after_hello", "silent"),
        ("wrong_id", "request not in flight"),
        ("int_id", "request not in flight"),
        ("oversize_stdout", "exceeds the 1000-byte cap"),
        ("bad_base64", "not valid base64"),
        ("extra_field", "invalid exec reply: evil"),
        ("string_exit_code", "invalid exec reply: exit_code"),
        ("flood_frame", "frame \\(cap"),
        ("huge_duration", "invalid exec reply: duration_ms"),
        ("deep_nesting", "nested deeper than"),
        ("huge_int", "not UTF-8 JSON"),
        ("dies_after_request", "closed the channel"),
    ],
)
async def test_lying_replies_break_the_client(mode: str, message: str) -> None:
    async with agent(mode) as guest:
        await guest.handshake(timeout=5.0)
        with pytest.raises(errors.SandboxError, match=message):
            await guest.exec(["true"], timeout=0.2, max_output=1000)
        # once lied to, the client never trusts the channel again, and says why
        with pytest.raises(errors.SandboxError, match="unusable after"):
            await guest.exec(["true"], timeout=0.2)


@pytest.mark.parametrize("mode", ["replay", "unasked"])
async def test_stale_or_unasked_replies_break_the_client(mode: str) -> None:
    async with agent(mode) as guest:
        await guest.handshake(timeout=5.0)
        first = await guest.exec(["true"], timeout=0.2, max_output=1000)
        assert first.stdout == "first\n"
        with pytest.raises(errors.SandboxError, match="request not in flight"):
            await guest.exec(["true"], timeout=0.2, max_output=1000)
        assert guest.broken


def test_request_ids_are_fresh_nonces() -> None:
    from ephemeral.sandbox.guest import _nonce

    ids = {_nonce() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    with pytest.raises(ValueError):
        p.PingRequest(id="1")


async def test_a_well_behaved_agent_works() -> None:
    async with agent("good") as guest:
        hello = await guest.handshake(timeout=5.0)
        assert hello.workdir == "/tmp/ephemeral-run-abc123/scratch"
        res = await guest.exec("echo hi")
        assert (res.exit_code, res.stdout) == (0, "hi\n")
        await guest.ping()
        assert await guest.kill_all() == 0


def test_request_frames_are_capped() -> None:
    with pytest.raises(errors.SandboxError, match="exceeds"):
        p.encode_frame({"data": "x" * (p.MAX_FRAME + 1)})


@pytest.mark.parametrize(
    "value",
    ["", "YQ==", "YWJj"],
)
def test_base64_decoding_respects_the_cap(value: str) -> None:
    assert len(p.b64decode(value, field="f", max_bytes=3)) <= 3


def test_base64_over_the_cap_is_refused_before_decoding() -> None:
    with pytest.raises(errors.SandboxError, match="cap"):
        p.b64decode("YWJjZA==", field="f", max_bytes=3)


async def test_read_frame_deadline_with_a_reader_that_never_answers() -> None:
    reader = asyncio.StreamReader()
    with pytest.raises(errors.SandboxError, match="silent"):
        await p.read_frame(reader, timeout=0.1)
