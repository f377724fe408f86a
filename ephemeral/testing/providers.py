"""Real HTTP servers on 127.0.0.1 that answer like the model APIs, from a script.

For tests and offline end-to-end runs: the adapters talk to these over a real socket, so the
request bytes, headers, status codes and error paths are the same as against the provider.

    with FakeOpenAIServer([FakeReply(body=openai_chat_response(content="hi"))],
                          api_key="sk-test") as server:
        settings = Settings(openai_base_url=server.base_url, openai_api_key="sk-test")
        ...
        server.requests[0].json()       # what the adapter sent

Each request takes the next scripted reply (a :class:`FakeReply`, or a function of the
request returning one). A request past the end of the script gets a 500 in the provider's
error shape and is counted in ``unexpected``.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, Final, Self

from ephemeral.broker.wire_render import (  # the builders live with the gateway; re-exported
    anthropic_message_response,
    anthropic_message_stream,
    openai_chat_response,
    openai_chat_stream,
    openai_responses_response,
    openai_responses_stream,
    sse,
)
from ephemeral.errors import EphemeralError
from ephemeral.providers.replay import load_cassette

# The wire-format builders live beside the gateway, which renders replayed turns with them;
# tests build their scripted replies from here.
__all__ = [
    "CapturedRequest",
    "FakeAnthropicServer",
    "FakeOpenAIServer",
    "FakeReply",
    "anthropic_message_response",
    "anthropic_message_stream",
    "openai_chat_response",
    "openai_chat_stream",
    "openai_responses_response",
    "openai_responses_stream",
    "sse",
]

MAX_REQUEST_BYTES: Final = 16 * 1024 * 1024


@dataclass
class FakeReply:
    status: int = 200
    body: dict[str, Any] | list[Any] | str | bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds to wait before answering (cut short when the server stops)
    # Server-sent events instead of ``body``: each item is written and flushed on its own,
    # ``chunk_delay`` seconds apart, and the connection closed after the last (a generator may
    # never end: a model that never stops).
    stream: Iterable[bytes] | None = None
    chunk_delay: float = 0.0


@dataclass
class CapturedRequest:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


Script = FakeReply | Callable[[CapturedRequest], FakeReply]


class _FakeModelServer:
    endpoints: ClassVar[frozenset[str]]
    url_suffix: ClassVar[str]

    def __init__(self, replies: Iterable[Script] = (), *, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.requests: list[CapturedRequest] = []
        self.unexpected = 0
        self._script: deque[Script] = deque(replies)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- what subclasses define -------------------------------------------------------------

    def authorized(self, headers: dict[str, str]) -> bool:
        raise NotImplementedError

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        raise NotImplementedError

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise EphemeralError("the fake server is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}{self.url_suffix}"

    def push(self, *replies: Script) -> None:
        with self._lock:
            self._script.extend(replies)

    def start(self) -> Self:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        server.daemon_threads = True
        server.block_on_close = False
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- one request ------------------------------------------------------------------------

    def _answer(self, req: CapturedRequest) -> FakeReply:
        with self._lock:
            self.requests.append(req)
        if req.method != "POST" or req.path not in self.endpoints:
            return FakeReply(404, self.error_body(404, f"no route {req.method} {req.path}"))
        if self.api_key is not None and not self.authorized(req.headers):
            return FakeReply(401, self.error_body(401, "invalid api key"))
        with self._lock:
            script = self._script.popleft() if self._script else None
            if script is None:
                self.unexpected += 1
        if script is None:
            return FakeReply(500, self.error_body(500, "fake server: script exhausted"))
        return script(req) if callable(script) else script


class FakeOpenAIServer(_FakeModelServer):
    """``POST /v1/chat/completions`` and ``/v1/responses``; base URL ends in ``/v1`` like
    OpenAI's."""

    endpoints = frozenset({"/v1/chat/completions", "/v1/responses"})
    url_suffix = "/v1"

    def authorized(self, headers: dict[str, str]) -> bool:
        return headers.get("authorization") == f"Bearer {self.api_key}"

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}

    @classmethod
    def from_cassette(cls, path: Path, *, api_key: str | None = None) -> Self:
        """A server that answers with a cassette's turns in Chat Completions form."""
        cassette = load_cassette(path)
        replies: list[Script] = [
            FakeReply(
                body=openai_chat_response(
                    content=t.message.content,
                    tool_calls=[(c.id, c.name, c.arguments) for c in t.message.tool_calls],
                    prompt_tokens=t.usage.input_tokens,
                    completion_tokens=t.usage.output_tokens,
                    cached_tokens=t.usage.cached_input_tokens,
                    model=cassette.model.partition("/")[2],
                )
            )
            for t in cassette.turns
        ]
        return cls(replies, api_key=api_key)


class FakeAnthropicServer(_FakeModelServer):
    """``POST /v1/messages``; base URL without ``/v1`` like Anthropic's."""

    endpoints = frozenset({"/v1/messages"})
    url_suffix = ""

    def authorized(self, headers: dict[str, str]) -> bool:
        return headers.get("x-api-key") == self.api_key and "anthropic-version" in headers

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
        return {
            "type": "error",
            "error": {"type": kind.get(status, "api_error"), "message": message},
        }

    @classmethod
    def from_cassette(cls, path: Path, *, api_key: str | None = None) -> Self:
        """A server that answers with a cassette's turns in Messages API form."""
        cassette = load_cassette(path)
        replies: list[Script] = [
            FakeReply(
                body=anthropic_message_response(
                    text=t.message.content,
                    tool_uses=[(c.id, c.name, c.arguments) for c in t.message.tool_calls],
                    input_tokens=t.usage.input_tokens - t.usage.cached_input_tokens,
                    cache_read_input_tokens=t.usage.cached_input_tokens,
                    output_tokens=t.usage.output_tokens,
                    model=cassette.model.partition("/")[2],
                )
            )
            for t in cassette.turns
        ]
        return cls(replies, api_key=api_key)


def _handler_for(fake: _FakeModelServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # One segment per answer, sent at once: with the head and the body written apart, a
        # keep-alive client waits out Nagle and a delayed ACK (40 ms) on every call.
        disable_nagle_algorithm = True
        wbufsize = 1 << 16

        def do_POST(self) -> None:
            self._handle()

        def do_GET(self) -> None:
            self._handle()

        def _handle(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            if length > MAX_REQUEST_BYTES:
                self.send_error(413)
                return
            body = self.rfile.read(length) if length else b""
            req = CapturedRequest(
                method=self.command,
                path=self.path,
                headers={k.lower(): v for k, v in self.headers.items()},
                body=body,
            )
            reply = fake._answer(req)
            if reply.delay and fake._stopping.wait(reply.delay):
                return
            if reply.stream is not None:
                self._stream(reply)
                return
            payload, ctype = _encode(reply.body)
            try:
                self.send_response(reply.status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(payload)))
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):
                return  # the client gave up (timeout tests); nothing to tell it

        def _stream(self, reply: FakeReply) -> None:
            self.close_connection = True  # the body ends when the connection does
            try:
                self.send_response(reply.status)
                self.send_header("content-type", "text/event-stream")
                self.send_header("cache-control", "no-cache")
                self.send_header("connection", "close")
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.flush()
                for chunk in reply.stream or ():
                    if reply.chunk_delay and fake._stopping.wait(reply.chunk_delay):
                        return
                    if fake._stopping.is_set():
                        return
                    self.wfile.write(chunk)
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                return  # the client hung up mid-stream

        def log_message(self, format: str, *args: Any) -> None:
            return  # keep test output clean

    return Handler


def _encode(body: dict[str, Any] | list[Any] | str | bytes | None) -> tuple[bytes, str]:
    if body is None:
        return b"", "application/json"
    if isinstance(body, bytes):
        return body, "application/json"
    if isinstance(body, str):
        return body.encode(), "application/json"
    return json.dumps(body).encode(), "application/json"
