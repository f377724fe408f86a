"""Anthropic Messages API over httpx. Streaming is off.

Differences from Chat Completions that this adapter hides:
- the system prompt is a top-level ``system`` field, not a message;
- tool calls are ``tool_use`` content blocks, and their results are ``tool_result`` blocks
  inside a *user* message;
- roles must alternate, so consecutive messages of one role are merged;
- ``usage.input_tokens`` excludes cache reads and writes; we report the total.
"""

from __future__ import annotations

from typing import Any, Final

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ephemeral.errors import ModelError
from ephemeral.money.pricing import estimate_tokens
from ephemeral.providers.base import (
    STOP_END,
    STOP_MAX_TOKENS,
    STOP_OTHER,
    STOP_REFUSAL,
    STOP_TOOL_USE,
    Message,
    ModelReply,
    ToolCall,
    ToolSpec,
    Usage,
    decode_arguments,
    first_error,
)
from ephemeral.providers.http import post_json

API_VERSION: Final = "2023-06-01"

_STOP: dict[str, str] = {
    "end_turn": STOP_END,
    "stop_sequence": STOP_END,
    "tool_use": STOP_TOOL_USE,
    "max_tokens": STOP_MAX_TOKENS,
    "model_context_window_exceeded": STOP_MAX_TOKENS,
    "refusal": STOP_REFUSAL,
}


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Block(_Wire):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None


class _Usage(_Wire):
    input_tokens: int = Field(default=0, ge=0)
    output_tokens: int = Field(default=0, ge=0)
    cache_creation_input_tokens: int | None = Field(default=None, ge=0)
    cache_read_input_tokens: int | None = Field(default=None, ge=0)


class _Reply(_Wire):
    content: list[_Block]
    stop_reason: str | None = None
    usage: _Usage | None = None


class AnthropicProvider:
    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None,
        name: str = "anthropic",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.name = name
        self._url = base_url.rstrip("/") + "/v1/messages"
        self._api_key = api_key
        self._transport = transport

    def __repr__(self) -> str:
        return f"AnthropicProvider(name={self.name!r}, url={self._url!r})"

    def request_body(
        self, *, model: str, messages: list[Message], tools: list[ToolSpec], max_tokens: int
    ) -> dict[str, Any]:
        system, turns = _wire_messages(messages)
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": turns}
        if system:
            body["system"] = system
        if tools:
            body["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.parameters}
                for t in tools
            ]
        return body

    async def complete(
        self,
        *,
        model: str,
        messages: list[Message],
        tools: list[ToolSpec],
        max_tokens: int,
        timeout: float,
    ) -> ModelReply:
        headers = {"anthropic-version": API_VERSION}
        if self._api_key:
            headers["x-api-key"] = self._api_key
        doc, latency_ms = await post_json(
            provider=self.name,
            url=self._url,
            headers=headers,
            body=self.request_body(
                model=model, messages=messages, tools=tools, max_tokens=max_tokens
            ),
            timeout=timeout,
            transport=self._transport,
            secret=self._api_key,
        )
        return self.parse_reply(doc, latency_ms, messages=messages, tools=tools)

    def parse_reply(
        self,
        doc: dict[str, Any],
        latency_ms: int,
        *,
        messages: list[Message],
        tools: list[ToolSpec],
    ) -> ModelReply:
        try:
            reply = _Reply.model_validate(doc)
        except ValidationError as exc:
            raise ModelError(
                f"{self.name}: the response does not match the Messages schema ({first_error(exc)})"
            ) from None
        texts: list[str] = []
        calls: list[ToolCall] = []
        for i, block in enumerate(reply.content):
            if block.type == "text" and block.text:
                texts.append(block.text)
            elif block.type == "tool_use":
                if not block.name:
                    raise ModelError(f"{self.name}: content.{i}: tool_use without a name")
                calls.append(
                    ToolCall(
                        id=block.id or f"toolu_{i}",
                        name=block.name,
                        arguments=decode_arguments(block.input),
                    )
                )
            # thinking and server-tool blocks carry nothing the loop can use
        message = Message(role="assistant", content="".join(texts) or None, tool_calls=calls)
        stop = _STOP.get(reply.stop_reason or "", STOP_OTHER)
        if reply.stop_reason is None:
            stop = STOP_TOOL_USE if calls else STOP_END
        return ModelReply(
            message=message,
            usage=_usage(reply.usage, message, messages, tools),
            stop_reason=stop,
            latency_ms=latency_ms,
        )


def _wire_messages(messages: list[Message]) -> tuple[str, list[dict[str, Any]]]:
    system_parts: list[str] = []
    turns: list[dict[str, Any]] = []
    leading = True
    for m in messages:
        if m.role == "system" and leading:
            if m.content:
                system_parts.append(m.content)
            continue
        leading = False
        role, blocks = _blocks(m)
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    return "\n\n".join(system_parts), turns


def _blocks(m: Message) -> tuple[str, list[dict[str, Any]]]:
    if m.role == "tool":
        # An empty text result is refused by the API; say so instead.
        return "user", [
            {
                "type": "tool_result",
                "tool_use_id": m.tool_call_id or "",
                "content": m.content or "(no output)",
            }
        ]
    if m.role == "assistant":
        blocks: list[dict[str, Any]] = []
        if m.content:
            blocks.append({"type": "text", "text": m.content})
        blocks.extend(
            {"type": "tool_use", "id": tc.id, "name": tc.name, "input": tc.arguments}
            for tc in m.tool_calls
        )
        # The API refuses an empty assistant turn.
        return "assistant", blocks or [{"type": "text", "text": "(no content)"}]
    # A system message after the conversation started has no place in `system` without
    # reordering history; it goes in as user text, labelled.
    text = m.content or "(empty)"
    if m.role == "system":
        text = f"[system] {text}"
    return "user", [{"type": "text", "text": text}]


def _usage(
    usage: _Usage | None, reply: Message, messages: list[Message], tools: list[ToolSpec]
) -> Usage:
    if usage is None:
        return Usage(
            input_tokens=estimate_tokens(messages, tools),
            output_tokens=estimate_tokens([reply], []),
        )
    cache_read = usage.cache_read_input_tokens or 0
    cache_write = usage.cache_creation_input_tokens or 0
    return Usage(
        input_tokens=usage.input_tokens + cache_read + cache_write,
        output_tokens=usage.output_tokens,
        cached_input_tokens=cache_read,
    )
