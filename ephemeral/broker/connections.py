"""The ``connection_call`` tool and the connection definitions behind it.

A connection is a base URL plus credential headers, stored per org (sealed) by
``ephemeral connections add``. The model names a connection, a method and a path; the broker
checks them against the run's policy (method allowed, path matched by one of the policy's
``fnmatch`` globs, no dot segments, no way to change scheme, host or port), adds the
credentials and calls the API. The model never sees or sets a header. Redirects are not
followed: they could carry the credentials to another host.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
import json
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import httpx

from ephemeral import errors
from ephemeral.broker import outbound
from ephemeral.broker.redact import Redactor
from ephemeral.broker.secrets import Sealer
from ephemeral.broker.ssrf import Refused, event_reason, resolve_within
from ephemeral.policy import Connection

if TYPE_CHECKING:
    from ephemeral.broker.context import BrokerContext

REQUEST_SECONDS = 30.0
MODEL_TEXT_CHARS = 16_000
MAX_BODY_BYTES = 256 * 1024
MAX_PATH_CHARS = 2048
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}$")  # RFC 9110 field name
# Headers that would let a stored connection steer the request itself rather than authenticate.
_RESERVED_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "upgrade",
        "te",
        "trailer",
        "expect",
        "proxy-connection",
        "keep-alive",
        "accept-encoding",
    }
)


# -- definitions (used by the CLI when adding a connection) ---------------------------------


def check_base_url(raw: str) -> str:
    """An http(s) base URL with a host, optional path prefix, no userinfo, query or fragment."""
    try:
        url = httpx.URL(raw)
    except (httpx.InvalidURL, ValueError) as exc:
        raise errors.InvalidRequest.field("--base-url", f"is not a valid URL: {exc}") from exc
    if url.scheme not in ("http", "https") or not url.host:
        raise errors.InvalidRequest.field("--base-url", "must be an http:// or https:// URL")
    if url.userinfo or url.query or url.fragment:
        raise errors.InvalidRequest.field(
            "--base-url", "must not carry credentials, a query string or a fragment"
        )
    return str(url).rstrip("/")


def parse_header(text: str, field: str = "--header") -> tuple[str, str]:
    """``'Name: value'`` → (name, value), refusing what could smuggle another header."""
    name, sep, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not sep or not _TOKEN.match(name):
        raise errors.InvalidRequest.field(field, "must look like 'Name: value'")
    if name.lower() in _RESERVED_HEADERS:
        raise errors.InvalidRequest.field(field, f"{name} is set by the broker, not a connection")
    if not value or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise errors.InvalidRequest.field(field, "needs a value without control characters")
    return name, value


# -- calls ----------------------------------------------------------------------------------


class Denied(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def check_path(path: object, allowed: Connection) -> str:
    """The path (and query) the model asked for, if the policy allows it; else Denied."""
    if not isinstance(path, str) or not path:
        raise Denied("path must be a non-empty string")
    if len(path) > MAX_PATH_CHARS:
        raise Denied(f"path longer than {MAX_PATH_CHARS} characters")
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in path):
        raise Denied("path contains whitespace or control characters")
    if not path.startswith("/") or path.startswith("//") or "\\" in path or "#" in path:
        raise Denied("path must start with a single '/' and be relative to the base URL")
    only_path = path.split("?", 1)[0]
    decoded = unquote(only_path)
    # "..;x" is ".." to servers that strip path parameters (Tomcat, Spring).
    segments = [seg.split(";", 1)[0] for seg in decoded.split("/")]
    if "\\" in decoded or any(seg in (".", "..") for seg in segments):
        raise Denied("path must not contain '.' or '..' segments")
    if not any(fnmatch.fnmatchcase(only_path, glob) for glob in allowed.paths):
        raise Denied(f"path {only_path!r} matches none of {', '.join(allowed.paths)}")
    return path


def join(base_url: str, path: str) -> httpx.URL:
    """Base URL + path, proven to keep the base's scheme, host, port and path prefix."""
    base = httpx.URL(base_url)
    try:
        url = httpx.URL(base_url.rstrip("/") + path)
    except (httpx.InvalidURL, ValueError) as exc:
        raise Denied(f"path does not form a valid URL: {str(exc)!r}") from exc
    prefix = base.path.rstrip("/")
    if (
        (url.scheme, url.host, url.port) != (base.scheme, base.host, base.port)
        or url.userinfo
        or not url.path.startswith(prefix + "/")
    ):
        raise Denied("path would leave the connection's base URL")
    return url


def _secret_parts(headers: dict[str, str]) -> list[str]:
    parts: list[str] = []
    for value in headers.values():
        parts.append(value)
        # "Bearer <token>": the token alone is the secret that matters.
        parts.extend(p for p in value.split() if len(p) >= 8)
    return [p for p in parts if p]


async def call(
    ctx: BrokerContext, args: dict[str, Any], *, sealer: Sealer, allow_private: bool
) -> str:
    name, method, path = args.get("name"), args.get("method"), args.get("path")
    body = args.get("body")
    shown_path = path.split("?", 1)[0][:MAX_PATH_CHARS] if isinstance(path, str) else ""

    async def deny(reason: str) -> str:
        await ctx.emit(
            "connection.denied",
            {
                "name": str(name)[:63],
                "method": str(method)[:16],
                "path": shown_path,
                "reason": event_reason(reason, zdr=ctx.policy.zero_data_retention),
            },
        )
        return f"error: connection call refused: {reason}"

    unknown = sorted(set(args) - {"name", "method", "path", "body"})
    if unknown:
        return await deny(f"unknown argument(s): {', '.join(unknown)}")
    allowed = next((c for c in ctx.policy.connections if c.name == name), None)
    if allowed is None:
        return await deny(f"connection {name!r} is not granted to this run")
    if not isinstance(method, str) or method.upper() not in allowed.methods:
        return await deny(
            f"method {method!r} is not allowed (allowed: {', '.join(allowed.methods)})"
        )
    method = method.upper()
    if body is not None and (not isinstance(body, str) or method in ("GET", "HEAD")):
        return await deny("body must be a string, and only with methods other than GET/HEAD")
    content = body.encode() if isinstance(body, str) else None
    if content is not None and len(content) > MAX_BODY_BYTES:
        return await deny(f"body larger than {MAX_BODY_BYTES} bytes")
    try:
        check_path(path, allowed)
    except Denied as exc:
        return await deny(exc.reason)
    try:
        stored = await ctx.get_connection(allowed.name)
    except errors.NotFound:
        return await deny(f"connection {allowed.name!r} no longer exists for this org")
    try:
        url = join(stored.base_url, str(path))
    except Denied as exc:
        return await deny(exc.reason)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.1, min(REQUEST_SECONDS, ctx.time_left()))
    try:
        target = await resolve_within(url, deadline - loop.time(), allow_private=allow_private)
    except Refused as exc:
        return await deny(exc.reason)
    credentials = sealer.open(stored.sealed_headers)
    headers = dict(credentials)
    if content is not None:
        headers["Content-Type"] = _content_type(body)
    status: int | None = None
    try:
        async with asyncio.timeout_at(deadline):
            response = await outbound.send(
                target, method, headers=headers, content=content, timeout=deadline - loop.time()
            )
        status = response.status
    except TimeoutError:
        return "error: the connection call timed out"
    except httpx.HTTPError as exc:
        return f"error: the connection call failed: {type(exc).__name__}"
    finally:
        await ctx.emit(
            "connection.requested",
            {"name": allowed.name, "method": method, "path": shown_path, "status": status},
        )
    return render(response, _secret_parts(credentials))


def _content_type(body: object) -> str:
    try:
        json.loads(str(body))
    except ValueError:
        return "text/plain; charset=utf-8"
    return "application/json"


def render(response: outbound.Response, secrets: list[str]) -> str:
    # Remove every form of each credential an API echoes back (e.g. a debugging endpoint),
    # before anything is cut. A body cut at the cap may end in part of a secret: what the
    # redactor still holds there is dropped, not shown.
    redactor = Redactor(secrets)
    body = redactor.feed(response.body)
    body += b"" if response.truncated else redactor.finish()
    response = dataclasses.replace(response, body=body)
    text = response.text()
    truncated = response.truncated
    if text is None:
        shown = (
            f"({len(response.body)} bytes of {response.content_type or 'unknown type'}; not shown)"
        )
    else:
        if len(text) > MODEL_TEXT_CHARS:
            text, truncated = text[:MODEL_TEXT_CHARS], True
        shown = text
    return (
        f"status: {response.status}\ncontent_type: {response.content_type or 'unknown'}\n"
        f"truncated: {'true' if truncated else 'false'}\nbody:\n{shown}"
    )
