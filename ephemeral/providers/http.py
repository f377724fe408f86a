"""One POST of JSON to a model API, with the error mapping every adapter shares.

Why not ``raise_for_status`` and ``from exc``: httpx exceptions hold the request, and the
request holds the API key header. Our errors are pickled (Prefect results) and logged, so they
carry only a redacted description of what happened, never an httpx object.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import json
import math
import re
import ssl
import time
from datetime import UTC, datetime
from typing import Any, Final

import httpx

from ephemeral.errors import ModelError, TransientModelError

MAX_RESPONSE_BYTES: Final = 8 * 1024 * 1024
MAX_RETRY_AFTER_SECONDS: Final = 600.0
MAX_DETAIL_CHARS: Final = 300
TRANSIENT_STATUSES: Final = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 529})

# Key-shaped tokens (sk-…, sk-ant-…, sk-or-…) are scrubbed even when they are not our key:
# a provider echoing some other credential back is no better.
_KEY_SHAPED = re.compile(r"\b(sk|pk|rk)-[A-Za-z0-9_\-]{8,}")


def redact(text: str, secret: str | None) -> str:
    if secret:
        text = text.replace(secret, "[redacted]")
    return _KEY_SHAPED.sub("[redacted]", text)


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # Building the CA bundle costs ~0.1 s; a client per call must not pay it every time.
    # An SSLContext is safe to share between threads and event loops.
    return httpx.create_ssl_context()


class _Borrowed(httpx.AsyncBaseTransport):
    """A transport the caller owns: our per-call client must not close it."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        return None


def parse_retry_after(headers: httpx.Headers) -> float | None:
    """Seconds to wait, from ``retry-after-ms`` (OpenAI) or ``retry-after`` (seconds or date)."""
    value = headers.get("retry-after-ms")
    if value is not None:
        try:
            return _clamp(float(value) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return _clamp(float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return _clamp((when - datetime.now(UTC)).total_seconds())


def _clamp(seconds: float) -> float | None:
    if math.isnan(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_SECONDS)


def _error_text(body: bytes) -> str:
    """The provider's own error message if the body has one, else the start of the body."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return body[:MAX_DETAIL_CHARS].decode("utf-8", "replace")
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])[:MAX_DETAIL_CHARS]
        if isinstance(err, str):
            return err[:MAX_DETAIL_CHARS]
    return body[:MAX_DETAIL_CHARS].decode("utf-8", "replace")


def _error_code(body: bytes) -> str | None:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        code = doc["error"].get("code") or doc["error"].get("type")
        return code if isinstance(code, str) else None
    return None


async def post_json(
    *,
    provider: str,
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
    timeout: float,
    transport: httpx.AsyncBaseTransport | None,
    secret: str | None,
) -> tuple[dict[str, Any], int]:
    """POST ``body``; return the decoded JSON object and the latency in milliseconds."""
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ModelError(f"{provider}: timeout must be a positive number of seconds")
    payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    started = time.monotonic()
    try:
        async with (
            asyncio.timeout(timeout),
            httpx.AsyncClient(
                transport=_Borrowed(transport) if transport is not None else None,
                verify=_ssl_context(),
                timeout=httpx.Timeout(timeout),
                follow_redirects=False,
            ) as client,
            client.stream(
                "POST",
                url,
                content=payload,
                headers={
                    "content-type": "application/json",
                    "accept": "application/json",
                    "user-agent": "ephemeral",
                }
                | headers,
            ) as resp,
        ):
            chunks: list[bytes] = []
            size = 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise ModelError(f"{provider}: response larger than {MAX_RESPONSE_BYTES} bytes")
                chunks.append(chunk)
            status, resp_headers = resp.status_code, resp.headers
    except (TimeoutError, httpx.TimeoutException):
        raise TransientModelError(f"{provider}: no answer within {timeout:g} s") from None
    except (httpx.UnsupportedProtocol, httpx.InvalidURL):
        raise ModelError(f"{provider}: the base URL is not a valid http(s) URL") from None
    except httpx.TransportError as exc:
        raise TransientModelError(f"{provider}: connection failed ({type(exc).__name__})") from None
    except httpx.HTTPError as exc:  # e.g. a body that fails to decode: retrying will not help
        raise ModelError(f"{provider}: bad response ({type(exc).__name__})") from None
    latency_ms = int((time.monotonic() - started) * 1000)
    raw = b"".join(chunks)
    if status >= 400:
        _raise_for_status(provider, status, resp_headers, raw, secret)
    if status != 200:
        raise ModelError(f"{provider}: unexpected HTTP {status}")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise ModelError(f"{provider}: malformed JSON in the response") from None
    if not isinstance(doc, dict):
        raise ModelError(f"{provider}: the response is not a JSON object")
    return doc, latency_ms


def _raise_for_status(
    provider: str, status: int, headers: httpx.Headers, raw: bytes, secret: str | None
) -> None:
    message = redact(_error_text(raw), secret)
    detail = f"{provider}: HTTP {status}: {message}".rstrip(": ")
    # OpenAI answers 429 for an exhausted quota too; waiting does not fix that.
    if status == 429 and _error_code(raw) == "insufficient_quota":
        raise ModelError(detail)
    if status in TRANSIENT_STATUSES or status >= 500:
        raise TransientModelError(detail, retry_after=parse_retry_after(headers))
    raise ModelError(detail)
