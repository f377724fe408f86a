"""The Anthropic Messages adapter against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

from ephemeral.providers.anthropic import AnthropicProvider
from ephemeral.providers.base import Message, ToolCall
from ephemeral.providers.registry import provider_for
from ephemeral.settings import Settings
from ephemeral.testing.providers import (
    FakeAnthropicServer,
    FakeReply,
    anthropic_message_response,
)

from .conftest import KEY, SHELL, conversation


async def test_request_shape_tool_use_and_tool_result_blocks(tmp_path: Path) -> None:
    reply = anthropic_message_response(
        text="Let me check the file.",
        tool_uses=[("toolu_01", "shell", {"command": "cat /tmp/proof.txt"})],
        input_tokens=900,
        output_tokens=41,
    )
    with FakeAnthropicServer([FakeReply(body=reply)], api_key=KEY) as server:
        settings = Settings.load(
            state_dir=tmp_path, anthropic_base_url=server.base_url, ANTHROPIC_API_KEY=KEY
        )
        provider, name = provider_for("anthropic/claude-sonnet-4-5", settings)
        out = await provider.complete(
            model=name, messages=conversation(), tools=[SHELL], max_tokens=300, timeout=10
        )
        [req] = server.requests

    assert req.path == "/v1/messages"
    body = req.json()
    assert body["model"] == "claude-sonnet-4-5"
    assert body["max_tokens"] == 300
    assert body["system"] == "You are a careful agent."
    assert "tool_choice" not in body
    assert body["tools"] == [
        {"name": "shell", "description": SHELL.description, "input_schema": SHELL.parameters}
    ]
    msgs = body["messages"]
    # roles alternate: both tool results and the note share one user message
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert all(m["role"] != "system" for m in msgs)
    assert msgs[0]["content"] == [{"type": "text", "text": "Run pwd and whoami."}]
    assert msgs[1]["content"] == [
        {"type": "text", "text": "Running both."},
        {"type": "tool_use", "id": "call_a", "name": "shell", "input": {"command": "pwd"}},
        {"type": "tool_use", "id": "call_b", "name": "shell", "input": {"command": "whoami"}},
    ]
    assert msgs[2]["content"] == [
        {"type": "tool_result", "tool_use_id": "call_a", "content": "/tmp/scratch\n"},
        {"type": "tool_result", "tool_use_id": "call_b", "content": "worker\n"},
        {"type": "text", "text": "[budget left: 39000 micro-dollars]"},
    ]

    assert out.message.content == "Let me check the file."
    assert out.message.tool_calls == [
        ToolCall(id="toolu_01", name="shell", arguments={"command": "cat /tmp/proof.txt"})
    ]
    assert out.stop_reason == "tool_use"
    assert (out.usage.input_tokens, out.usage.output_tokens) == (900, 41)
    assert out.provider_cost_micros is None


async def test_usage_counts_cache_reads_and_writes_as_input() -> None:
    reply = anthropic_message_response(
        text="done",
        input_tokens=100,
        cache_read_input_tokens=3000,
        cache_creation_input_tokens=250,
        output_tokens=20,
    )
    with FakeAnthropicServer([FakeReply(body=reply)]) as server:
        provider = AnthropicProvider(base_url=server.base_url, api_key=None)
        out = await provider.complete(
            model="m", messages=conversation()[:2], tools=[], max_tokens=64, timeout=10
        )
        assert "tools" not in server.requests[0].json()
    assert out.usage.input_tokens == 3350
    assert out.usage.cached_input_tokens == 3000
    assert out.usage.output_tokens == 20
    assert out.stop_reason == "end"
    assert out.message.tool_calls == []


async def test_stop_reasons_are_normalised() -> None:
    replies = [
        FakeReply(body=anthropic_message_response(text="cut", stop_reason="max_tokens")),
        FakeReply(body=anthropic_message_response(text="no", stop_reason="refusal")),
        FakeReply(body=anthropic_message_response(text="x", stop_reason="pause_turn")),
    ]
    with FakeAnthropicServer(replies) as server:
        provider = AnthropicProvider(base_url=server.base_url, api_key=None)
        got = [
            (
                await provider.complete(
                    model="m", messages=conversation()[:2], tools=[], max_tokens=8, timeout=10
                )
            ).stop_reason
            for _ in replies
        ]
    assert got == ["max_tokens", "refusal", "other"]


def test_later_system_messages_become_labelled_user_text() -> None:
    provider = AnthropicProvider(base_url="http://127.0.0.1:1", api_key=None)
    body = provider.request_body(
        model="m",
        messages=[
            Message(role="system", content="one"),
            Message(role="system", content="two"),
            Message(role="user", content="hi"),
            Message(role="assistant", content="hello"),
            Message(role="system", content="time is short"),
        ],
        tools=[],
        max_tokens=8,
    )
    assert body["system"] == "one\n\ntwo"
    assert body["messages"][-1] == {
        "role": "user",
        "content": [{"type": "text", "text": "[system] time is short"}],
    }


async def test_thinking_blocks_are_ignored_and_text_blocks_joined() -> None:
    reply = anthropic_message_response(text="Part one. ")
    reply["content"] = [
        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
        *reply["content"],
        {"type": "text", "text": "Part two."},
    ]
    with FakeAnthropicServer([FakeReply(body=reply)]) as server:
        provider = AnthropicProvider(base_url=server.base_url, api_key=None)
        out = await provider.complete(
            model="m", messages=conversation()[:2], tools=[], max_tokens=8, timeout=10
        )
    assert out.message.content == "Part one. Part two."
