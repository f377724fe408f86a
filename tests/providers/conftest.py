"""Shared pieces for the provider tests: the shell tool the agent offers, a short conversation."""

from __future__ import annotations

import socket

import pytest

from ephemeral.providers.base import Message, ToolCall, ToolSpec

SHELL = ToolSpec(
    name="shell",
    description="Run a shell command in the sandbox.",
    parameters={
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
)

KEY = "sk-test-9f8e7d6c5b4a39281706"


def conversation() -> list[Message]:
    """System, user, an assistant turn with two tool calls, both results, a user note."""
    return [
        Message(role="system", content="You are a careful agent."),
        Message(role="user", content="Run pwd and whoami."),
        Message(
            role="assistant",
            content="Running both.",
            tool_calls=[
                ToolCall(id="call_a", name="shell", arguments={"command": "pwd"}),
                ToolCall(id="call_b", name="shell", arguments={"command": "whoami"}),
            ],
        ),
        Message(role="tool", tool_call_id="call_a", content="/tmp/scratch\n"),
        Message(role="tool", tool_call_id="call_b", content="worker\n"),
        Message(role="user", content="[budget left: 39000 micro-dollars]"),
    ]


@pytest.fixture
def closed_port() -> int:
    """A loopback port with nothing listening on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
