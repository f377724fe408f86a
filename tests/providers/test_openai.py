"""The Chat Completions adapter against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

from ephemeral.providers.base import Message, ToolCall
from ephemeral.providers.openai import OpenAIProvider
from ephemeral.providers.registry import provider_for
from ephemeral.settings import Settings
from ephemeral.testing.providers import FakeOpenAIServer, FakeReply, openai_chat_response

from .conftest import KEY, SHELL, conversation


async def test_tool_call_round_trip_request_shape_and_reply() -> None:
    reply = openai_chat_response(
        tool_calls=[("call_c", "shell", {"command": "ls -l /tmp"})],
        prompt_tokens=812,
        completion_tokens=37,
    )
    with FakeOpenAIServer([FakeReply(body=reply)], api_key=KEY) as server:
        provider = OpenAIProvider(base_url=server.base_url, api_key=KEY)
        out = await provider.complete(
            model="gpt-6-luna", messages=conversation(), tools=[SHELL], max_tokens=512, timeout=10
        )
        [req] = server.requests

    assert req.path == "/v1/chat/completions"
    assert req.headers["authorization"] == f"Bearer {KEY}"
    assert req.headers["content-type"] == "application/json"
    body = req.json()
    assert body["model"] == "gpt-6-luna"
    assert body["max_tokens"] == 512
    assert body["stream"] is False
    assert "tool_choice" not in body  # the default, auto
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "shell",
                "description": SHELL.description,
                "parameters": SHELL.parameters,
            },
        }
    ]
    msgs = body["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert msgs[2]["content"] == "Running both."
    call = msgs[2]["tool_calls"][0]
    assert call["id"] == "call_a" and call["type"] == "function"
    assert call["function"]["name"] == "shell"
    assert json.loads(call["function"]["arguments"]) == {"command": "pwd"}
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_a", "content": "/tmp/scratch\n"}
    assert "tool_calls" not in msgs[1]

    assert out.stop_reason == "tool_use"
    assert out.message.role == "assistant"
    assert out.message.tool_calls == [
        ToolCall(id="call_c", name="shell", arguments={"command": "ls -l /tmp"})
    ]
    assert out.usage.input_tokens == 812
    assert out.usage.output_tokens == 37
    assert out.usage.cached_input_tokens == 0
    assert out.provider_cost_micros is None
    assert out.latency_ms >= 0


async def test_text_answer_and_cached_tokens() -> None:
    reply = openai_chat_response(
        content="All done.", prompt_tokens=2048, completion_tokens=12, cached_tokens=1536
    )
    with FakeOpenAIServer([FakeReply(body=reply)]) as server:
        provider = OpenAIProvider(base_url=server.base_url, api_key=None)
        out = await provider.complete(
            model="m", messages=conversation()[:2], tools=[], max_tokens=64, timeout=10
        )
        body = server.requests[0].json()
        # a local server without a key gets no Authorization header at all
        assert "authorization" not in server.requests[0].headers
    assert "tools" not in body
    assert out.message.content == "All done."
    assert out.message.tool_calls == []
    assert out.stop_reason == "end"
    assert (out.usage.input_tokens, out.usage.cached_input_tokens) == (2048, 1536)


async def test_length_finish_is_max_tokens() -> None:
    reply = openai_chat_response(content="partial", finish_reason="length", completion_tokens=64)
    with FakeOpenAIServer([FakeReply(body=reply)]) as server:
        provider = OpenAIProvider(base_url=server.base_url, api_key=None)
        out = await provider.complete(
            model="m", messages=conversation()[:2], tools=[], max_tokens=64, timeout=10
        )
    assert out.stop_reason == "max_tokens"


async def test_tool_calls_with_finish_stop_still_mean_tool_use() -> None:
    # Some OpenAI-compatible servers report "stop" while returning tool calls.
    reply = openai_chat_response(
        tool_calls=[("c1", "shell", {"command": "id"})], finish_reason="stop"
    )
    with FakeOpenAIServer([FakeReply(body=reply)]) as server:
        provider = OpenAIProvider(base_url=server.base_url, api_key=None)
        out = await provider.complete(
            model="m", messages=conversation()[:2], tools=[SHELL], max_tokens=64, timeout=10
        )
    assert out.stop_reason == "tool_use"


async def test_invalid_tool_arguments_are_kept_raw_and_sent_back_verbatim() -> None:
    raw = '{"command": "ls -l'  # truncated JSON from the model
    with FakeOpenAIServer(
        [
            FakeReply(body=openai_chat_response(tool_calls=[("c1", "shell", raw)])),
            FakeReply(body=openai_chat_response(content="ok")),
        ]
    ) as server:
        provider = OpenAIProvider(base_url=server.base_url, api_key=None)
        first = await provider.complete(
            model="m", messages=conversation()[:2], tools=[SHELL], max_tokens=64, timeout=10
        )
        [call] = first.message.tool_calls
        assert call.arguments == {"_raw": raw}
        assert call.arguments_invalid
        history = [
            *conversation()[:2],
            first.message,
            Message(role="tool", tool_call_id="c1", content="error: arguments are not JSON"),
        ]
        await provider.complete(
            model="m", messages=history, tools=[SHELL], max_tokens=64, timeout=10
        )
        sent = server.requests[1].json()["messages"][2]["tool_calls"][0]["function"]["arguments"]
    assert sent == raw


async def test_non_object_arguments_are_kept_raw() -> None:
    with FakeOpenAIServer(
        [FakeReply(body=openai_chat_response(tool_calls=[("c1", "shell", "[1, 2]")]))]
    ) as server:
        provider = OpenAIProvider(base_url=server.base_url, api_key=None)
        out = await provider.complete(
            model="m", messages=conversation()[:2], tools=[SHELL], max_tokens=64, timeout=10
        )
    assert out.message.tool_calls[0].arguments == {"_raw": "[1, 2]"}


async def test_missing_usage_is_estimated_not_free() -> None:
    reply = openai_chat_response(content="hello there")
    del reply["usage"]
    with FakeOpenAIServer([FakeReply(body=reply)]) as server:
        provider = OpenAIProvider(base_url=server.base_url, api_key=None)
        out = await provider.complete(
            model="m", messages=conversation(), tools=[SHELL], max_tokens=64, timeout=10
        )
    assert out.usage.input_tokens > 50
    assert out.usage.output_tokens > 0


async def test_openrouter_cost_headers_and_body(tmp_path: Path) -> None:
    reply = openai_chat_response(
        content="hi", prompt_tokens=100, completion_tokens=10, cost=0.0001234
    )
    with FakeOpenAIServer([FakeReply(body=reply)], api_key=KEY) as server:
        settings = Settings.load(
            state_dir=tmp_path, openrouter_base_url=server.base_url, OPENROUTER_API_KEY=KEY
        )
        provider, name = provider_for("openrouter/anthropic/claude-sonnet-4.5", settings)
        out = await provider.complete(
            model=name, messages=conversation()[:2], tools=[], max_tokens=64, timeout=10
        )
        req = server.requests[0]
    assert name == "anthropic/claude-sonnet-4.5"
    assert req.json()["model"] == "anthropic/claude-sonnet-4.5"
    assert req.json()["usage"] == {"include": True}
    assert req.headers["authorization"] == f"Bearer {KEY}"
    assert req.headers["x-title"] == "Ephemeral"
    assert out.provider_cost_micros == 124  # 123.4 micros, rounded up


def test_official_openai_gets_max_completion_tokens() -> None:
    def body(provider: OpenAIProvider) -> dict[str, object]:
        return provider.request_body(
            model="m", messages=conversation()[:2], tools=[], max_tokens=99
        )

    official = body(OpenAIProvider(base_url="https://api.openai.com/v1", api_key="sk-x"))
    local = body(OpenAIProvider(base_url="http://127.0.0.1:11434/v1", api_key=None))
    assert official["max_completion_tokens"] == 99
    assert "max_tokens" not in official
    assert local["max_tokens"] == 99
    assert "max_completion_tokens" not in local


def test_decode_arguments_cases() -> None:
    from ephemeral.providers.base import decode_arguments

    assert decode_arguments(None) == {}
    assert decode_arguments("") == {}
    assert decode_arguments('{"a": 1}') == {"a": 1}
    assert decode_arguments({"a": 1}) == {"a": 1}
    assert decode_arguments('"just a string"') == {"_raw": '"just a string"'}
    assert decode_arguments(42) == {"_raw": "42"}
