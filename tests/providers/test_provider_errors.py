"""Error paths shared by both HTTP adapters, against real servers on 127.0.0.1."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest

from ephemeral.errors import ModelError, TransientModelError
from ephemeral.providers.anthropic import AnthropicProvider
from ephemeral.providers.base import Provider
from ephemeral.providers.http import MAX_RESPONSE_BYTES
from ephemeral.providers.openai import OpenAIProvider
from ephemeral.testing.providers import (
    FakeAnthropicServer,
    FakeOpenAIServer,
    FakeReply,
    anthropic_message_response,
    openai_chat_response,
)

from .conftest import KEY, SHELL, conversation


@dataclass
class Flavour:
    name: str
    server: type[FakeOpenAIServer] | type[FakeAnthropicServer]
    ok_body: dict[str, Any]

    def provider(self, base_url: str, api_key: str | None = KEY) -> Provider:
        if self.server is FakeOpenAIServer:
            return OpenAIProvider(base_url=base_url, api_key=api_key)
        return AnthropicProvider(base_url=base_url, api_key=api_key)

    def error(self, message: str, kind: str = "api_error", code: str | None = None) -> dict:
        if self.server is FakeOpenAIServer:
            return {"error": {"message": message, "type": kind, "param": None, "code": code}}
        return {"type": "error", "error": {"type": kind, "message": message}}


FLAVOURS = [
    Flavour("openai", FakeOpenAIServer, openai_chat_response(content="ok")),
    Flavour("anthropic", FakeAnthropicServer, anthropic_message_response(text="ok")),
]


@pytest.fixture(params=FLAVOURS, ids=lambda f: f.name)
def flavour(request: pytest.FixtureRequest) -> Iterator[Flavour]:
    yield request.param


async def _call(provider: Provider, timeout: float = 10) -> Any:
    return await provider.complete(
        model="m", messages=conversation(), tools=[SHELL], max_tokens=32, timeout=timeout
    )


async def _fails(flavour: Flavour, *replies: FakeReply, timeout: float = 10) -> ModelError:
    with flavour.server(list(replies), api_key=KEY) as server, pytest.raises(ModelError) as info:
        await _call(flavour.provider(server.base_url), timeout=timeout)
    return info.value


async def test_key_sent_in_the_providers_header(flavour: Flavour) -> None:
    with flavour.server([FakeReply(body=flavour.ok_body)], api_key=KEY) as server:
        out = await _call(flavour.provider(server.base_url))
        headers = server.requests[0].headers
    assert out.message.content == "ok"
    if flavour.name == "openai":
        assert headers["authorization"] == f"Bearer {KEY}"
        assert "x-api-key" not in headers
    else:
        assert headers["x-api-key"] == KEY
        assert headers["anthropic-version"] == "2023-06-01"
        assert "authorization" not in headers


async def test_429_with_retry_after_seconds_is_transient(flavour: Flavour) -> None:
    err = await _fails(
        flavour,
        FakeReply(429, flavour.error("slow down", "rate_limit_error"), {"retry-after": "7"}),
    )
    assert isinstance(err, TransientModelError)
    assert err.retry_after == 7.0
    assert "429" in err.detail and "slow down" in err.detail


async def test_429_with_retry_after_ms_and_http_date(flavour: Flavour) -> None:
    err = await _fails(flavour, FakeReply(429, flavour.error("x"), {"retry-after-ms": "1500"}))
    assert isinstance(err, TransientModelError) and err.retry_after == 1.5
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=120), usegmt=True)
    err = await _fails(flavour, FakeReply(429, flavour.error("x"), {"retry-after": when}))
    assert isinstance(err, TransientModelError)
    assert err.retry_after is not None and 60 < err.retry_after <= 120


async def test_429_without_retry_after(flavour: Flavour) -> None:
    err = await _fails(flavour, FakeReply(429, flavour.error("busy")))
    assert isinstance(err, TransientModelError) and err.retry_after is None


async def test_openai_quota_429_is_not_transient() -> None:
    f = FLAVOURS[0]
    err = await _fails(
        f,
        FakeReply(
            429, f.error("You exceeded your quota", "insufficient_quota", "insufficient_quota")
        ),
    )
    assert not isinstance(err, TransientModelError)


@pytest.mark.parametrize("status", [500, 502, 503, 529])
async def test_5xx_is_transient(flavour: Flavour, status: int) -> None:
    err = await _fails(flavour, FakeReply(status, flavour.error("overloaded", "overloaded_error")))
    assert isinstance(err, TransientModelError)
    assert str(status) in err.detail


async def test_400_is_a_model_error_with_the_providers_message(flavour: Flavour) -> None:
    err = await _fails(
        flavour, FakeReply(400, flavour.error("max_tokens: too large", "invalid_request_error"))
    )
    assert not isinstance(err, TransientModelError)
    assert "HTTP 400" in err.detail and "max_tokens: too large" in err.detail


async def test_malformed_json_is_a_model_error(flavour: Flavour) -> None:
    err = await _fails(flavour, FakeReply(200, b'{"choices": [ {"message": '))
    assert not isinstance(err, TransientModelError)
    assert "malformed JSON" in err.detail


async def test_schema_mismatch_is_a_model_error(flavour: Flavour) -> None:
    err = await _fails(flavour, FakeReply(200, {"id": "x", "object": "surprise"}))
    assert not isinstance(err, TransientModelError)
    assert "schema" in err.detail


async def test_negative_token_count_is_a_schema_mismatch(flavour: Flavour) -> None:
    body = dict(flavour.ok_body)
    body["usage"] = {"prompt_tokens": -5, "input_tokens": -5, "output_tokens": 1}
    err = await _fails(flavour, FakeReply(200, body))
    assert "schema" in err.detail


async def test_oversized_response_is_refused(flavour: Flavour) -> None:
    huge = b'{"pad": "' + b"x" * (MAX_RESPONSE_BYTES + 10) + b'"}'
    err = await _fails(flavour, FakeReply(200, huge))
    assert "larger than" in err.detail


async def test_timeout_is_transient(flavour: Flavour) -> None:
    err = await _fails(flavour, FakeReply(200, flavour.ok_body, delay=30), timeout=0.3)
    assert isinstance(err, TransientModelError)
    assert "no answer within" in err.detail


async def test_connection_refused_is_transient(flavour: Flavour, closed_port: int) -> None:
    base = f"http://127.0.0.1:{closed_port}" + ("/v1" if flavour.name == "openai" else "")
    with pytest.raises(TransientModelError) as info:
        await _call(flavour.provider(base))
    assert "connection failed" in info.value.detail


async def test_api_key_never_appears_in_errors(flavour: Flavour, closed_port: int) -> None:
    # The provider echoes the key back, as OpenAI's "Incorrect API key provided: …" does.
    echo = flavour.error(f"Incorrect API key provided: {KEY}. Also sk-other-abcdef123456.")
    errors: list[ModelError] = [
        await _fails(flavour, FakeReply(401, echo)),
        await _fails(flavour, FakeReply(500, echo)),
        await _fails(flavour, FakeReply(200, flavour.ok_body, delay=30), timeout=0.2),
    ]
    with pytest.raises(ModelError) as refused:
        await _call(flavour.provider(f"http://127.0.0.1:{closed_port}"))
    errors.append(refused.value)
    with (
        flavour.server([], api_key="a-different-key") as server,
        pytest.raises(ModelError) as wrong,
    ):
        await _call(flavour.provider(server.base_url))
    errors.append(wrong.value)
    for err in errors:
        for text in (str(err), err.detail, repr(err), repr(err.to_problem())):
            assert KEY not in text
            assert "sk-other-abcdef123456" not in text
        # Errors travel pickled (Prefect task results): no httpx request with headers inside.
        assert KEY.encode() not in pickle.dumps(err)
        assert err.__cause__ is None
    assert "[redacted]" in errors[0].detail
    assert KEY not in repr(flavour.provider("http://127.0.0.1:1"))


async def test_script_exhausted_is_visible(flavour: Flavour) -> None:
    with flavour.server([], api_key=KEY) as server:
        with pytest.raises(TransientModelError):
            await _call(flavour.provider(server.base_url))
        assert server.unexpected == 1


async def test_hostile_bodies_are_model_errors(flavour: Flavour) -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    err = await _fails(flavour, FakeReply(200, deep))
    assert not isinstance(err, TransientModelError)
    err = await _fails(flavour, FakeReply(200, b"not gzip", {"content-encoding": "gzip"}))
    assert not isinstance(err, TransientModelError)
    err = await _fails(flavour, FakeReply(200, [1, 2, 3]))
    assert "not a JSON object" in err.detail


async def test_unusable_base_url_is_not_retried(flavour: Flavour) -> None:
    with pytest.raises(ModelError) as info:
        await _call(flavour.provider("ftp://127.0.0.1:1/v1"))
    assert not isinstance(info.value, TransientModelError)
    assert "base URL" in info.value.detail
