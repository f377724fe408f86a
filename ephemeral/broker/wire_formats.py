"""The providers' wire formats, built: whole responses and server-sent event streams in the
real shape of the OpenAI Chat Completions and Responses APIs and the Anthropic Messages API.

The gateway renders replayed turns with these (``gateway_wire.render``); the local model
servers of ``ephemeral.testing.providers`` answer with them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def openai_chat_response(
    *,
    content: str | None = None,
    tool_calls: Sequence[tuple[str, str, dict[str, Any] | str]] = (),
    finish_reason: str | None = None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    cached_tokens: int | None = None,
    cost: float | None = None,
    model: str = "gpt-6-luna",
) -> dict[str, Any]:
    """A Chat Completions response; tool-call arguments given as a string are sent verbatim."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if tool_calls:
        message["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
            for call_id, name, args in tool_calls
        ]
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens, "audio_tokens": 0}
    if cost is not None:
        usage["cost"] = cost
    return {
        "id": "chatcmpl-fake0001",
        "object": "chat.completion",
        "created": 1_790_000_000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason or ("tool_calls" if tool_calls else "stop"),
            }
        ],
        "usage": usage,
        "system_fingerprint": "fp_fake",
    }


def anthropic_message_response(
    *,
    text: str | None = None,
    tool_uses: Sequence[tuple[str, str, dict[str, Any]]] = (),
    stop_reason: str | None = None,
    input_tokens: int = 0,
    output_tokens: int = 0,
    cache_read_input_tokens: int = 0,
    cache_creation_input_tokens: int = 0,
    model: str = "claude-sonnet-4-5",
) -> dict[str, Any]:
    """A Messages API response (``input_tokens`` is the uncached part, as Anthropic reports)."""
    content: list[dict[str, Any]] = []
    if text is not None:
        content.append({"type": "text", "text": text})
    content.extend(
        {"type": "tool_use", "id": call_id, "name": name, "input": args}
        for call_id, name, args in tool_uses
    )
    return {
        "id": "msg_fake0001",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason or ("tool_use" if tool_uses else "end_turn"),
        "stop_sequence": None,
        "usage": {
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": cache_creation_input_tokens,
            "cache_read_input_tokens": cache_read_input_tokens,
            "service_tier": "standard",
        },
    }


# --- streams (server-sent events) in each provider's real shape ------------------------------


def sse(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event (``data: [DONE]`` when ``data`` is a string)."""
    text = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


def openai_chat_stream(
    pieces: Sequence[str],
    *,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    include_usage: bool = True,
    finish_reason: str = "stop",
    model: str = "gpt-6-luna",
) -> list[bytes]:
    """A streamed Chat Completion: a role chunk, one chunk per piece, the finish chunk, the
    usage chunk (``stream_options.include_usage``) and ``[DONE]``."""
    base = {"id": "chatcmpl-fake0001", "object": "chat.completion.chunk", "created": 1_790_000_000}
    base["model"] = model

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse({**base, "choices": [choice], "usage": None})

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": p}) for p in pieces]
    out.append(chunk({}, finish_reason))
    if include_usage:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        out.append(sse({**base, "choices": [], "usage": usage}))
    out.append(sse("[DONE]"))
    return out


def anthropic_message_stream(
    pieces: Sequence[str],
    *,
    input_tokens: int = 0,
    output_tokens: int = 0,
    stop_reason: str = "end_turn",
    model: str = "claude-sonnet-4-5",
) -> list[bytes]:
    """A streamed Messages API answer: message_start (input tokens), one text block in
    deltas, message_delta (the output tokens) and message_stop."""
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_fake0001",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 1},
        },
    }
    out = [
        sse(start, "message_start"),
        sse(
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            "content_block_start",
        ),
    ]
    out += [
        sse(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}},
            "content_block_delta",
        )
        for p in pieces
    ]
    out += [
        sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
        sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": output_tokens},
            },
            "message_delta",
        ),
        sse({"type": "message_stop"}, "message_stop"),
    ]
    return out


def openai_responses_response(
    *,
    text: str | None = None,
    function_calls: Sequence[tuple[str, str, dict[str, Any]]] = (),
    input_tokens: int = 0,
    output_tokens: int = 0,
    cached_tokens: int = 0,
    model: str = "gpt-6-luna",
) -> dict[str, Any]:
    """A Responses API answer (``POST /v1/responses``)."""
    output: list[dict[str, Any]] = []
    if text is not None:
        output.append(
            {
                "type": "message",
                "id": "msg_fake0001",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        )
    output.extend(
        {
            "type": "function_call",
            "id": f"fc_{call_id}",
            "call_id": call_id,
            "name": name,
            "arguments": json.dumps(args),
            "status": "completed",
        }
        for call_id, name, args in function_calls
    )
    return {
        "id": "resp_fake0001",
        "object": "response",
        "created_at": 1_790_000_000,
        "status": "completed",
        "model": model,
        "output": output,
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
    }


def openai_responses_stream(
    pieces: Sequence[str],
    *,
    input_tokens: int = 0,
    output_tokens: int = 0,
    model: str = "gpt-6-luna",
) -> list[bytes]:
    """A streamed Responses API answer: response.created, text deltas, response.completed."""
    done = openai_responses_response(
        text="".join(pieces), input_tokens=input_tokens, output_tokens=output_tokens, model=model
    )
    created = {**done, "status": "in_progress", "output": [], "usage": None}
    out = [sse({"type": "response.created", "response": created}, "response.created")]
    out += [
        sse(
            {
                "type": "response.output_text.delta",
                "item_id": "msg_fake0001",
                "output_index": 0,
                "content_index": 0,
                "delta": p,
            },
            "response.output_text.delta",
        )
        for p in pieces
    ]
    out.append(sse({"type": "response.completed", "response": done}, "response.completed"))
    return out
