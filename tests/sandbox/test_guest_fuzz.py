"""Fuzz the host side of the guest protocol: whatever bytes a hostile agent sends, the host gets
a SandboxError or a reply whose every field is inside the documented bounds. Never another
exception, never a value a record column cannot hold."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from ephemeral import errors
from ephemeral.sandbox import protocol as p

REPLIES: list[type[BaseModel]] = [
    p.Hello,
    p.ErrorReply,
    p.ExecReply,
    p.GetReply,
    p.PutReply,
    p.ReseedReply,
    p.EmptyReply,
]
INT64 = (-(1 << 63), (1 << 63) - 1)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# JSON values that stress the bounds: huge and negative ints, long strings, nesting, wrong types.
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([1 << 63, (1 << 63) - 1, -(1 << 63) - 1, 1 << 64, 10**30, -1, 0, 511, 512]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=50),
    st.sampled_from(["", "YWJj", "/tmp/ephemeral-run-abc/scratch", "hello", "x" * 5000]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
_field_names = st.sampled_from(
    sorted({name for m in REPLIES for name in m.model_fields} | {"evil", ""})
)
_frames = st.dictionaries(st.one_of(_field_names, st.text(max_size=8)), _values, max_size=10)


def assert_bounded(model: BaseModel) -> None:
    """Every int fits a BIGINT column and every string fits one frame."""
    for name, value in model:
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            assert INT64[0] <= value <= INT64[1], (name, value)
        if isinstance(value, str):
            assert len(value) <= p.MAX_TEXT, name
    if isinstance(model, p.ExecReply):
        assert -1 <= model.exit_code <= 511
        assert 0 <= model.duration_ms <= p.MAX_DURATION_MS
    if isinstance(model, p.Hello):
        assert 1 <= model.pid <= p.MAX_PID and 0 <= model.uid <= p.MAX_UID
    if isinstance(model, p.PutReply):
        assert 0 <= model.size <= p.MAX_FRAME


def parse_all(obj: dict[str, Any]) -> None:
    for model in REPLIES:
        try:
            reply = p.parse(model, obj, "reply")
        except errors.SandboxError:
            continue
        assert_bounded(reply)


async def read(data: bytes, max_frame: int = p.MAX_FRAME) -> dict[str, Any]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return await p.read_frame(reader, timeout=1.0, max_frame=max_frame)


@FUZZ
@given(st.binary(max_size=512))
def test_any_bytes_on_the_channel(data: bytes) -> None:
    try:
        obj = asyncio.run(read(data))
    except errors.SandboxError:
        return
    assert isinstance(obj, dict)
    parse_all(obj)


@FUZZ
@given(st.binary(max_size=2048))
def test_any_frame_body(body: bytes) -> None:
    try:
        obj = p.decode_frame(body)
    except errors.SandboxError:
        return
    parse_all(obj)


@FUZZ
@given(_frames)
def test_any_json_object(obj: dict[str, Any]) -> None:
    body = json.dumps(obj).encode()
    try:
        decoded = p.decode_frame(body)
    except errors.SandboxError:
        return
    parse_all(decoded)


@FUZZ
@given(
    st.fixed_dictionaries(
        {
            "id": st.integers(),
            "ok": st.just(True),
            "exit_code": st.integers(),
            "stdout": st.just(""),
            "stderr": st.just(""),
            "truncated": st.booleans(),
            "timed_out": st.booleans(),
            "duration_ms": st.integers(),
        }
    )
)
def test_exec_replies_with_any_numbers(obj: dict[str, Any]) -> None:
    """The shape the records writer once choked on: only the numbers vary."""
    try:
        reply = p.parse(p.ExecReply, p.decode_frame(json.dumps(obj).encode()), "exec reply")
    except errors.SandboxError:
        return
    assert_bounded(reply)


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,
        b'{"a":' * 100_000,
        b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"a":' + b"[" * (p.MAX_DEPTH + 1) + b"]" * (p.MAX_DEPTH + 1) + b"}",
    ],
)
def test_deep_nesting_is_a_sandbox_error(body: bytes) -> None:
    with pytest.raises(errors.SandboxError, match="nested deeper than"):
        p.decode_frame(body)


def test_nesting_up_to_the_bound_is_accepted() -> None:
    depth = p.MAX_DEPTH - 1
    body = b'{"a":' + b"[" * depth + b"]" * depth + b"}"
    assert p.decode_frame(body) is not None


@pytest.mark.parametrize(
    "body",
    [
        b'{"duration_ms": 1' + b"0" * 5000 + b"}",  # past int's max_str_digits: ValueError
        b'{"a": "\\ud800"}' + b"\xff",
        b"\xef\xbb\xbf{}",
        b'{"a": 1e999999}',
        b"",
    ],
)
def test_malformed_bodies_are_sandbox_errors(body: bytes) -> None:
    try:
        obj = p.decode_frame(body)
    except errors.SandboxError:
        return
    parse_all(obj)


def test_a_reply_of_two_to_the_63_ms_is_refused() -> None:
    obj = {
        "id": "0" * 32,  # a well-formed nonce: only duration_ms is wrong
        "ok": True,
        "exit_code": 0,
        "stdout": "",
        "stderr": "",
        "truncated": False,
        "timed_out": False,
        "duration_ms": 1 << 63,
    }
    with pytest.raises(errors.SandboxError, match="duration_ms"):
        p.parse(p.ExecReply, obj, "exec reply")


def test_error_messages_do_not_repeat_long_guest_keys() -> None:
    with pytest.raises(errors.SandboxError) as info:
        p.parse(p.EmptyReply, {"id": "0" * 32, "ok": True, "k" * 100_000: 1}, "ping reply")
    assert len(str(info.value)) < 400
