"""The wire formats the model gateway speaks (``ephemeral.broker.gateway``): usage and
assistant turns read from answers and streams, replayed turns rendered as answers and streams,
HTTP/1.1 response heads for the guest."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Final

import httpx

from ephemeral import errors
from ephemeral.broker import wire_formats as wire
from ephemeral.providers.anthropic import AnthropicProvider
from ephemeral.providers.base import Message, ToolCall, Usage, decode_arguments
from ephemeral.providers.openai import OpenAIProvider

if TYPE_CHECKING:
    from ephemeral.broker.egress import GuestStream

RESPONSE_CAP: Final = 8 << 20
CHAT, RESPONSES, MESSAGES = "chat.completions", "responses", "messages"


def max_tokens(api: str, body: dict[str, Any]) -> tuple[str, Any]:
    if api == RESPONSES:
        return "max_output_tokens", body.get("max_output_tokens")
    if api == MESSAGES:
        return "max_tokens", body.get("max_tokens")
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            return name, body[name]
    return "max_tokens", None


def response_head(status: int, headers: dict[str, str], length: int | None) -> bytes:
    """A response head: ``Content-Length`` when ``length`` is known, else chunked."""
    chunked = length is None
    lines = [f"HTTP/1.1 {status} {PHRASES.get(status, 'Status')}"]
    for k, v in headers.items():
        lines.append(f"{k}: {v}")
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}")
    lines += ["Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1", "replace")


PHRASES: Final = {
    200: "OK",
    400: "Bad Request",
    402: "Payment Required",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    504: "Gateway Timeout",
}


async def write_json(stream: GuestStream, status: int, doc: dict[str, Any]) -> None:
    raw = json.dumps(doc).encode()
    await stream.write(response_head(status, {"content-type": "application/json"}, len(raw)) + raw)


async def read_capped(response: httpx.Response) -> bytes:
    out = bytearray()
    async for chunk in response.aiter_raw():
        out += chunk
        if len(out) > RESPONSE_CAP:
            raise httpx.ReadError("the model's answer is larger than the gateway's cap")
    return bytes(out)


def event_end(buf: bytes) -> int:
    """The end of the first whole server-sent event in ``buf`` (after its blank line), or -1."""
    ends = [i + n for i, n in ((buf.find(b"\n\n"), 2), (buf.find(b"\r\n\r\n"), 4)) if i >= 0]
    return min(ends) if ends else -1


def usage_of(api: str, doc: dict[str, Any]) -> Usage | None:
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return None
    return usage_dict(api, usage)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def usage_dict(api: str, u: dict[str, Any]) -> Usage:
    if api == MESSAGES:
        cached = _int(u.get("cache_read_input_tokens"))
        total = _int(u.get("input_tokens")) + cached + _int(u.get("cache_creation_input_tokens"))
        return Usage(
            input_tokens=total,
            output_tokens=_int(u.get("output_tokens")),
            cached_input_tokens=cached,
        )
    if api == RESPONSES:
        details = u.get("input_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
        inp = _int(u.get("input_tokens"))
        return Usage(
            input_tokens=inp,
            output_tokens=_int(u.get("output_tokens")),
            cached_input_tokens=min(cached, inp),
        )
    details = u.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
    inp = _int(u.get("prompt_tokens"))
    return Usage(
        input_tokens=inp,
        output_tokens=_int(u.get("completion_tokens")),
        cached_input_tokens=min(cached, inp),
    )


def turn_of(api: str, doc: dict[str, Any]) -> dict[str, Any] | None:
    """The assistant turn of a whole answer, in a cassette's shape (None when unreadable)."""
    try:
        if api == CHAT:
            provider = OpenAIProvider(base_url="http://model.internal/v1", api_key=None)
            reply = provider.parse_reply(doc, 0, messages=[], tools=[])
        elif api == MESSAGES:
            reply = AnthropicProvider(base_url="http://model.internal", api_key=None).parse_reply(
                doc, 0, messages=[], tools=[]
            )
        else:
            return _responses_turn(doc)
    except errors.ModelError:
        return None
    return {
        "message": reply.message.model_dump(),
        "usage": reply.usage.model_dump(),
        "latency_ms": 0,
    }


def _responses_turn(doc: dict[str, Any]) -> dict[str, Any] | None:
    output = doc.get("output")
    if not isinstance(output, list):
        return None
    texts: list[str] = []
    calls: list[ToolCall] = []
    for item in output:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            for part in item.get("content") or []:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    texts.append(part["text"])
        elif item.get("type") == "function_call" and isinstance(item.get("name"), str):
            calls.append(
                ToolCall(
                    id=str(item.get("call_id") or f"call_{len(calls)}"),
                    name=item["name"],
                    arguments=decode_arguments(item.get("arguments")),
                )
            )
    message = Message(role="assistant", content="".join(texts) or None, tool_calls=calls)
    usage = usage_of(RESPONSES, doc) or Usage()
    return {"message": message.model_dump(), "usage": usage.model_dump(), "latency_ms": 0}


class StreamFolder:
    """Reads a stream's events as they pass: its usage, and the assistant turn they add up to."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.usage: Usage | None = None
        self.final = False
        self.text: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}
        self.completed: dict[str, Any] | None = None

    def feed(self, event: bytes) -> bool:
        """Fold one event; False for the usage-only chunk a client did not ask for."""
        data = b"\n".join(
            line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")
        )
        if not data or data == b"[DONE]":
            return True
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            return True
        if not isinstance(doc, dict):
            return True
        if self.api == CHAT:
            return self._chat(doc)
        if self.api == MESSAGES:
            self._messages(doc)
        else:
            self._responses(doc)
        return True

    def _chat(self, doc: dict[str, Any]) -> bool:
        usage = doc.get("usage")
        choices = doc.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            if isinstance(delta.get("content"), str):
                self.text.append(delta["content"])
            for tc in delta.get("tool_calls") or []:
                if not isinstance(tc, dict):
                    continue
                slot = self.calls.setdefault(
                    _int(tc.get("index")), {"id": "", "name": "", "args": ""}
                )
                if isinstance(tc.get("id"), str):
                    slot["id"] = tc["id"]
                fn = tc.get("function")
                if isinstance(fn, dict):
                    if isinstance(fn.get("name"), str):
                        slot["name"] += fn["name"]
                    if isinstance(fn.get("arguments"), str):
                        slot["args"] += fn["arguments"]
        if isinstance(usage, dict):
            self.usage, self.final = usage_dict(CHAT, usage), True
            return bool(choices)  # the usage-only chunk is the gateway's, unless asked for
        return True

    def _messages(self, doc: dict[str, Any]) -> None:
        kind = doc.get("type")
        if kind == "message_start" and isinstance(doc.get("message"), dict):
            usage = doc["message"].get("usage")
            if isinstance(usage, dict):
                self.usage = usage_dict(MESSAGES, usage)
        elif kind == "message_delta" and isinstance(doc.get("usage"), dict):
            u = doc["usage"]
            base = self.usage or Usage()
            out = _int(u.get("output_tokens"))
            inp = base.input_tokens
            if "input_tokens" in u:
                inp = max(inp, usage_dict(MESSAGES, u).input_tokens)
            self.usage = Usage(
                input_tokens=inp, output_tokens=out, cached_input_tokens=base.cached_input_tokens
            )
            self.final = True
        elif kind == "content_block_start" and isinstance(doc.get("content_block"), dict):
            block = doc["content_block"]
            if block.get("type") == "tool_use":
                self.calls[_int(doc.get("index"))] = {
                    "id": str(block.get("id") or ""),
                    "name": str(block.get("name") or ""),
                    "args": "",
                }
        elif kind == "content_block_delta" and isinstance(doc.get("delta"), dict):
            delta = doc["delta"]
            if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                self.text.append(delta["text"])
            elif delta.get("type") == "input_json_delta":
                slot = self.calls.get(_int(doc.get("index")))
                if slot is not None and isinstance(delta.get("partial_json"), str):
                    slot["args"] += delta["partial_json"]

    def _responses(self, doc: dict[str, Any]) -> None:
        kind = doc.get("type")
        response = doc.get("response")
        if kind in ("response.completed", "response.incomplete") and isinstance(response, dict):
            self.usage = usage_of(RESPONSES, response)
            self.final = self.usage is not None
            self.completed = response
        elif kind == "response.output_text.delta" and isinstance(doc.get("delta"), str):
            self.text.append(doc["delta"])

    def turn(self) -> dict[str, Any] | None:
        if self.completed is not None:
            return _responses_turn(self.completed)
        calls = [
            ToolCall(
                id=c["id"] or f"call_{i}", name=c["name"], arguments=decode_arguments(c["args"])
            )
            for i, c in sorted(self.calls.items())
            if c["name"]
        ]
        message = Message(role="assistant", content="".join(self.text) or None, tool_calls=calls)
        usage = self.usage or Usage()
        return {"message": message.model_dump(), "usage": usage.model_dump(), "latency_ms": 0}


def assistant_turns(api: str, body: dict[str, Any]) -> int:
    """How many assistant turns the conversation already holds (which cassette turn is next)."""
    if api == RESPONSES:
        items = body.get("input")
        if not isinstance(items, list):
            return 0
        turns, previous = 0, False
        for item in items:
            mine = isinstance(item, dict) and (
                item.get("role") == "assistant" or item.get("type") == "function_call"
            )
            turns += int(mine and not previous)
            previous = mine
        return turns
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


def render(
    api: str,
    text: str | None,
    calls: list[tuple[str, str, dict[str, Any]]],
    usage: Usage,
    model: str,
) -> dict[str, Any]:
    if api == MESSAGES:
        return wire.anthropic_message_response(
            text=text,
            tool_uses=calls,
            input_tokens=usage.input_tokens - usage.cached_input_tokens,
            cache_read_input_tokens=usage.cached_input_tokens,
            output_tokens=usage.output_tokens,
            model=model,
        )
    if api == RESPONSES:
        return wire.openai_responses_response(
            text=text,
            function_calls=calls,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_tokens=usage.cached_input_tokens,
            model=model,
        )
    return wire.openai_chat_response(
        content=text,
        tool_calls=calls,
        prompt_tokens=usage.input_tokens,
        completion_tokens=usage.output_tokens,
        cached_tokens=usage.cached_input_tokens,
        model=model,
    )


def _pieces(text: str | None) -> list[str]:
    if not text:
        return []
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + [words[-1]]


def render_stream(
    api: str,
    text: str | None,
    calls: list[tuple[str, str, dict[str, Any]]],
    usage: Usage,
    model: str,
    body: dict[str, Any],
) -> list[bytes]:
    pieces = _pieces(text)
    if api == MESSAGES:
        events = wire.anthropic_message_stream(
            pieces,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            stop_reason="tool_use" if calls else "end_turn",
            model=model,
        )
        if calls:  # the tool calls as whole blocks after the text
            extra = []
            for i, (call_id, name, args) in enumerate(calls, start=1):
                block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
                extra += [
                    wire.sse(
                        {"type": "content_block_start", "index": i, "content_block": block},
                        "content_block_start",
                    ),
                    wire.sse(
                        {
                            "type": "content_block_delta",
                            "index": i,
                            "delta": {"type": "input_json_delta", "partial_json": json.dumps(args)},
                        },
                        "content_block_delta",
                    ),
                    wire.sse({"type": "content_block_stop", "index": i}, "content_block_stop"),
                ]
            events = events[:-2] + extra + events[-2:]
        return events
    if api == RESPONSES:
        done = render(api, text, calls, usage, model)
        events = wire.openai_responses_stream(
            pieces, input_tokens=usage.input_tokens, output_tokens=usage.output_tokens, model=model
        )
        completed = {"type": "response.completed", "response": done}
        return [*events[:-1], wire.sse(completed, "response.completed")]
    options = body.get("stream_options")
    include = isinstance(options, dict) and options.get("include_usage") is True
    events = wire.openai_chat_stream(
        pieces,
        prompt_tokens=usage.input_tokens,
        completion_tokens=usage.output_tokens,
        include_usage=include,
        finish_reason="tool_calls" if calls else "stop",
        model=model,
    )
    if calls:
        deltas = [
            {
                "index": i,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
            for i, (call_id, name, args) in enumerate(calls)
        ]
        chunk = {
            "id": "chatcmpl-replay",
            "object": "chat.completion.chunk",
            "created": 1_790_000_000,
            "model": model,
            "choices": [{"index": 0, "delta": {"tool_calls": deltas}, "finish_reason": None}],
        }
        events.insert(1 + len(pieces), wire.sse(chunk))
    return events
