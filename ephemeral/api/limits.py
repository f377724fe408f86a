"""Body size (413) and content type (415) checks, before any byte of a body is parsed.

A pure ASGI middleware: it refuses on ``Content-Length`` when the client declares one, and counts
the bytes of a chunked body as they arrive, so a client that lies or streams cannot make the
server buffer more than the limit.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ephemeral import errors
from ephemeral.policy import MAX_FILES_BYTES, MAX_PROMPT_CHARS
from ephemeral.sessions.requests import MAX_FILE_BYTES as MAX_SANDBOX_FILE_BYTES

# Base64 grows files by 4/3; the prompt may be 4 bytes per character in UTF-8; plus slack for
# the other fields. Anything above cannot be a valid run request.
MAX_API_BODY_BYTES = MAX_FILES_BYTES * 4 // 3 + MAX_PROMPT_CHARS * 4 + (256 << 10)
MAX_FORM_BODY_BYTES = MAX_PROMPT_CHARS * 4 + (64 << 10)
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _is_sandbox_file(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 5 and parts[1:3] == ["v1", "sandboxes"] and parts[4] == "files"


def _is_json(content_type: str) -> bool:
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (
        mime.startswith("application/") and mime.endswith("+json")
    )


async def _send_problem(send: Send, exc: errors.EphemeralError) -> None:
    body = json.dumps(exc.to_problem()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": exc.status,
            "headers": [
                (b"content-type", b"application/problem+json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimits:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        api = scope["path"].startswith("/v1/")
        limit = MAX_API_BODY_BYTES if api else MAX_FORM_BODY_BYTES
        # PUT /v1/sandboxes/{id}/files carries the file's raw bytes (any type, up to 128 MiB).
        raw = scope["method"] == "PUT" and _is_sandbox_file(scope["path"])
        if raw:
            limit = MAX_SANDBOX_FILE_BYTES
        declared = headers.get("content-length")
        has_body = "transfer-encoding" in headers or (declared not in (None, "", "0"))
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _send_problem(
                    send, errors.InvalidRequest.field("Content-Length", "is not a number")
                )
                return
            if size > limit:
                await _send_problem(send, self._too_large(limit))
                return
        if api and not raw and has_body and not _is_json(headers.get("content-type", "")):
            await _send_problem(
                send,
                errors.UnsupportedMediaType(
                    "the body must be JSON (Content-Type: application/json), got "
                    f"{headers.get('content-type') or 'no Content-Type'}",
                    errors=[{"field": "Content-Type", "message": "must be application/json"}],
                ),
            )
            return

        if declared is None and has_body:
            # Chunked: buffer up to the limit (the server enforces Content-Length itself).
            chunks: list[bytes] = []
            seen = 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                chunk = message.get("body", b"")
                seen += len(chunk)
                if seen > limit:
                    await _send_problem(send, self._too_large(limit))
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            replay: list[Message] = [
                {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            ]

            async def buffered() -> Message:
                return replay.pop() if replay else await receive()

            await self.app(scope, buffered, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _too_large(limit: int) -> errors.PayloadTooLarge:
        return errors.PayloadTooLarge(
            f"the request body is larger than {limit} bytes",
            errors=[{"field": "body", "message": f"must be at most {limit} bytes"}],
        )
