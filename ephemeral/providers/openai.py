"""Chat Completions over httpx: OpenAI, and every server that speaks its wire format
(OpenRouter, vLLM, Ollama, llama.cpp) through a different base URL. Streaming is off."""

from __future__ import annotations

import json
from decimal import ROUND_CEILING, Decimal, InvalidOperation
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ephemeral.errors import ModelError
from ephemeral.money.pricing import estimate_tokens
from ephemeral.providers.base import (
    RAW_ARGUMENTS_KEY,
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

MaxTokensField = Literal["max_tokens", "max_completion_tokens"]

_FINISH: dict[str, str] = {
    "stop": STOP_END,
    "tool_calls": STOP_TOOL_USE,
    "function_call": STOP_TOOL_USE,
    "length": STOP_MAX_TOKENS,
    "content_filter": STOP_REFUSAL,
}


# --- wire models of the response (extra fields allowed: servers add their own) -------------


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Function(_Wire):
    name: str
    arguments: str | dict[str, Any] | None = None


class _ToolCall(_Wire):
    id: str | None = None
    type: str | None = "function"
    function: _Function


class _ReplyMessage(_Wire):
    role: str | None = "assistant"
    content: str | list[dict[str, Any]] | None = None
    refusal: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Choice(_Wire):
    message: _ReplyMessage
    finish_reason: str | None = None


class _PromptDetails(_Wire):
    cached_tokens: int | None = Field(default=None, ge=0)


class _Usage(_Wire):
    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    prompt_tokens_details: _PromptDetails | None = None
    cost: float | None = None  # OpenRouter: credits, 1 credit = 1 USD


class _ChatCompletion(_Wire):
    choices: list[_Choice] = Field(min_length=1)
    usage: _Usage | None = None


# --- the adapter --------------------------------------------------------------------------


class OpenAIProvider:
    """One Chat Completions endpoint. A client per call: Prefect may run each model step on
    its own event loop, and an httpx client must not cross loops."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None,
        name: str = "openai",
        transport: httpx.AsyncBaseTransport | None = None,
        extra_headers: dict[str, str] | None = None,
        max_tokens_field: MaxTokensField | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self._url = base_url.rstrip("/") + "/chat/completions"
        self._api_key = api_key
        self._transport = transport
        self._extra_headers = dict(extra_headers or {})
        self._extra_body = dict(extra_body or {})
        # OpenAI itself rejects `max_tokens` for its reasoning models; the compatible servers
        # (vLLM, Ollama, llama.cpp, OpenRouter) all understand `max_tokens`.
        if max_tokens_field is None:
            host = urlsplit(base_url).hostname or ""
            max_tokens_field = "max_completion_tokens" if host == "api.openai.com" else "max_tokens"
        self._max_tokens_field: MaxTokensField = max_tokens_field

    def __repr__(self) -> str:
        return f"OpenAIProvider(name={self.name!r}, url={self._url!r})"

    def request_body(
        self, *, model: str, messages: list[Message], tools: list[ToolSpec], max_tokens: int
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "messages": [_wire_message(m) for m in messages],
            self._max_tokens_field: max_tokens,
            "stream": False,
        }
        if tools:
            # tool_choice is left out: the default, "auto", lets the model answer in prose.
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.parameters,
                    },
                }
                for t in tools
            ]
        return body | self._extra_body

    async def complete(
        self,
        *,
        model: str,
        messages: list[Message],
        tools: list[ToolSpec],
        max_tokens: int,
        timeout: float,
    ) -> ModelReply:
        headers = dict(self._extra_headers)
        if self._api_key:
            headers["authorization"] = f"Bearer {self._api_key}"
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
            completion = _ChatCompletion.model_validate(doc)
        except ValidationError as exc:
            raise ModelError(
                f"{self.name}: the response does not match the Chat Completions schema "
                f"({first_error(exc)})"
            ) from None
        choice = completion.choices[0]
        calls = [
            ToolCall(
                id=tc.id or f"call_{i}",
                name=tc.function.name,
                arguments=decode_arguments(tc.function.arguments),
            )
            for i, tc in enumerate(choice.message.tool_calls or [])
        ]
        content = _text(choice.message.content)
        if content is None and choice.message.refusal:
            content = choice.message.refusal
        message = Message(role="assistant", content=content, tool_calls=calls)
        stop = _FINISH.get(choice.finish_reason or "", STOP_OTHER)
        # Some compatible servers say "stop" (or nothing) while returning tool calls.
        if calls and stop in (STOP_END, STOP_OTHER):
            stop = STOP_TOOL_USE
        if choice.finish_reason is None and not calls:
            stop = STOP_END
        if choice.message.refusal and not calls:
            stop = STOP_REFUSAL
        return ModelReply(
            message=message,
            usage=_usage(completion.usage, message, messages, tools),
            stop_reason=stop,
            latency_ms=latency_ms,
            provider_cost_micros=_cost_micros(completion.usage),
        )


def _wire_message(m: Message) -> dict[str, Any]:
    if m.role == "tool":
        return {"role": "tool", "tool_call_id": m.tool_call_id or "", "content": m.content or ""}
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    # null content is only valid on an assistant turn that carries tool calls
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        out["content"] = ""
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": tc.id,
                "type": "function",
                "function": {"name": tc.name, "arguments": _encode_arguments(tc)},
            }
            for tc in m.tool_calls
        ]
    return out


def _encode_arguments(tc: ToolCall) -> str:
    # Send back exactly what the model wrote, so its own history stays truthful.
    if tc.arguments_invalid:
        return str(tc.arguments[RAW_ARGUMENTS_KEY])
    return json.dumps(tc.arguments, ensure_ascii=False)


def _text(content: str | list[dict[str, Any]] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts = [p.get("text") for p in content if isinstance(p, dict)]
    return "".join(p for p in parts if isinstance(p, str)) or None


def _usage(
    usage: _Usage | None, reply: Message, messages: list[Message], tools: list[ToolSpec]
) -> Usage:
    if usage is None:
        # A server that reports no usage must not make the call free: charge our
        # conservative estimate instead.
        return Usage(
            input_tokens=estimate_tokens(messages, tools),
            output_tokens=estimate_tokens([reply], []),
        )
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None
    return Usage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        cached_input_tokens=min(cached or 0, usage.prompt_tokens),
    )


def _cost_micros(usage: _Usage | None) -> int | None:
    if usage is None or usage.cost is None:
        return None
    try:
        micros = (Decimal(str(usage.cost)) * 1_000_000).to_integral_value(ROUND_CEILING)
    except InvalidOperation:
        return None
    if not micros.is_finite() or micros < 0:
        return None
    return int(micros)
