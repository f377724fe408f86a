"""One outbound HTTP request from the host to a checked address, with a size cap and a deadline.

Nothing here follows redirects, keeps cookies, reads proxy variables or asks for compressed
bodies (a small gzip body can inflate a thousandfold before any cap applies). The connection
goes to the address :mod:`ephemeral.broker.ssrf` checked; the Host header and TLS SNI keep the
name, so certificates are still verified against it.
"""

from __future__ import annotations

import functools
import logging
import ssl
from contextvars import ContextVar
from dataclasses import dataclass

import httpx

from ephemeral.broker.ssrf import Target

BODY_CAP = 256 * 1024  # bytes read from upstream per request
USER_AGENT = "ephemeral-broker/1"
_TEXT_TYPES = ("json", "xml", "javascript", "x-www-form-urlencoded", "yaml", "csv")


@dataclass(frozen=True)
class Response:
    status: int
    content_type: str
    location: str | None
    body: bytes
    truncated: bool
    encoded: bool  # the server compressed the body although we asked it not to

    def text(self) -> str | None:
        """The body as text, or None when it is binary or compressed (not shown to the model)."""
        if self.encoded:
            return None
        ctype = self.content_type.lower()
        if ctype and not (ctype.startswith("text/") or any(t in ctype for t in _TEXT_TYPES)):
            return None
        charset = "utf-8"
        for part in ctype.split(";")[1:]:
            key, _, value = part.strip().partition("=")
            if key == "charset" and value:
                charset = value.strip('"')
        try:
            return self.body.decode(charset, errors="replace")
        except LookupError:
            return self.body.decode("utf-8", errors="replace")


_SENDING: ContextVar[bool] = ContextVar("broker_sending", default=False)


class _HideBrokerRequests(logging.Filter):
    """httpx logs every request URL at INFO, and a broker URL may carry a query-string secret."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _SENDING.get()


# httpcore's DEBUG traces show response headers, which an API may use to echo a credential.
for _name in ("httpx", "httpcore.connection", "httpcore.http11", "httpcore.http2"):
    logging.getLogger(_name).addFilter(_HideBrokerRequests())


@functools.cache
def _tls() -> ssl.SSLContext:
    # Loading the CA bundle takes ~0.1 s; one verifying context serves every request.
    return httpx.create_ssl_context()


async def send(
    target: Target,
    method: str,
    *,
    headers: dict[str, str] | None = None,
    content: bytes | None = None,
    timeout: float,
    cap: int = BODY_CAP,
) -> Response:
    """Make one request; raises httpx.HTTPError (or TimeoutError from the caller's deadline)."""
    url = target.url
    sent = {
        "Host": url.netloc.decode("ascii"),
        "User-Agent": USER_AGENT,
        "Accept": "*/*",
        "Accept-Encoding": "identity",
    }
    sent.update(headers or {})
    extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
    token = _SENDING.set(True)
    try:
        return await _send(target, method, sent, content, extensions, timeout, cap)
    finally:
        _SENDING.reset(token)


async def _send(
    target: Target,
    method: str,
    sent: dict[str, str],
    content: bytes | None,
    extensions: dict[str, str],
    timeout: float,
    cap: int,
) -> Response:
    async with httpx.AsyncClient(
        trust_env=False,
        follow_redirects=False,
        timeout=httpx.Timeout(max(0.1, timeout)),
        verify=_tls(),
    ) as client:
        request = client.build_request(
            method, target.dial_url, headers=sent, content=content, extensions=extensions
        )
        response = await client.send(request, stream=True)
        try:
            body = bytearray()
            truncated = False
            if method != "HEAD":
                async for chunk in response.aiter_raw():
                    body += chunk
                    if len(body) > cap:
                        del body[cap:]
                        truncated = True
                        break
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            return Response(
                status=response.status_code,
                content_type=response.headers.get("content-type", ""),
                location=response.headers.get("location"),
                body=bytes(body),
                truncated=truncated,
                encoded=encoding not in ("", "identity"),
            )
        finally:
            await response.aclose()
