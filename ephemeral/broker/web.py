"""The ``web_fetch`` tool: GET/HEAD of a public URL, made by the host, charged per request.

Each hop (the first request and every redirect, at most :data:`MAX_REDIRECTS`) is checked by
:mod:`ephemeral.broker.ssrf`, charged *before* it is sent, and recorded as ``web.requested``
with the URL stripped of its query string. A refused hop is ``web.denied`` and costs nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpx

from ephemeral.broker import outbound
from ephemeral.broker.ssrf import (
    PrivateAllow,
    Refused,
    event_reason,
    parse_url,
    public_url,
    resolve,
)
from ephemeral.policy import WebAllow

if TYPE_CHECKING:
    from ephemeral.broker.context import BrokerContext

METHODS = ("GET", "HEAD")
MAX_REDIRECTS = 5
REQUEST_SECONDS = 30.0  # a whole fetch, redirects included, never outlives the run either
MODEL_TEXT_CHARS = 16_000
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})

Charge = Callable[[], Awaitable[int]]


def _shown(raw: object) -> str:
    return public_url(raw) if isinstance(raw, str) else "(not a string)"


async def fetch(
    ctx: BrokerContext,
    args: dict[str, Any],
    *,
    charge: Charge,
    allow_private: bool,
    allowed: PrivateAllow | None = None,
) -> str:
    method = args.get("method", "GET")
    raw = args.get("url")

    async def deny(url: str, reason: str) -> str:
        await ctx.emit(
            "web.denied",
            {
                "method": str(method)[:16],
                "url": url,
                "reason": event_reason(reason, zdr=ctx.policy.zero_data_retention),
                "cost_micros": 0,
            },
        )
        return f"error: web request refused: {reason}"

    unknown = sorted(set(args) - {"url", "method"})
    if unknown:
        return await deny(_shown(raw), f"unknown argument(s): {', '.join(unknown)}")
    if method not in METHODS:
        return await deny(_shown(raw), "method must be GET or HEAD")
    try:
        url = parse_url(raw)
    except Refused as exc:
        return await deny(_shown(raw), exc.reason)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.1, min(REQUEST_SECONDS, ctx.time_left()))
    hops = 0
    while True:
        allow = ctx.policy.web
        if isinstance(allow, WebAllow) and not allow.allows(url.host):
            return await deny(public_url(url), f"host {url.host!r} is not in the web allow list")
        try:
            async with asyncio.timeout_at(deadline):
                target = await resolve(url, allow_private=allow_private, allowed=allowed)
        except Refused as exc:
            return await deny(
                public_url(url), f"{'redirect refused: ' if hops else ''}{exc.reason}"
            )
        except TimeoutError:
            return await deny(public_url(url), "timed out resolving the host")
        cost = await charge()  # raises StopRun("budget_exhausted") when it does not fit
        status: int | None = None
        try:
            async with asyncio.timeout_at(deadline):
                response = await outbound.send(target, method, timeout=deadline - loop.time())
            status = response.status
        except TimeoutError:
            return "error: the web request timed out"
        except httpx.HTTPError as exc:
            return f"error: the web request failed: {type(exc).__name__}"
        finally:
            await ctx.emit(
                "web.requested",
                {"method": method, "url": public_url(url), "status": status, "cost_micros": cost},
            )
        if response.status in REDIRECT_STATUSES and response.location:
            hops += 1
            try:
                nxt = url.join(response.location)
            except (httpx.InvalidURL, ValueError):
                return await deny(public_url(url), "the redirect location is not a valid URL")
            if hops > MAX_REDIRECTS:
                return await deny(public_url(nxt), f"more than {MAX_REDIRECTS} redirects")
            try:
                url = parse_url(str(nxt))
            except Refused as exc:
                return await deny(public_url(nxt), f"redirect refused: {exc.reason}")
            continue
        return render(url, response)


def render(url: httpx.URL, response: outbound.Response) -> str:
    text = response.text()
    truncated = response.truncated
    if text is None:
        body = (
            f"({len(response.body)} bytes of {response.content_type or 'unknown type'}"
            f"{', compressed' if response.encoded else ''}; not shown)"
        )
    else:
        if len(text) > MODEL_TEXT_CHARS:
            text, truncated = text[:MODEL_TEXT_CHARS], True
        body = text
    return (
        f"status: {response.status}\nurl: {url}\n"
        f"content_type: {response.content_type or 'unknown'}\n"
        f"truncated: {'true' if truncated else 'false'}\nbody:\n{body}"
    )
