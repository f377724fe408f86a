"""The model gateway: ``http://model.internal/`` inside the sandbox, metered by the host.

Code inside the sandbox (an agent, an SDK, curl) calls a model the way it calls any API, at
``$OPENAI_BASE_URL`` / ``$ANTHROPIC_BASE_URL``; the request reaches the host through the egress
proxy (``ephemeral.broker.egress`` routes the host name ``model.internal`` here) and the host
makes the call with the real key, which never enters the sandbox.

Served: the OpenAI wire format (``POST /v1/chat/completions``, ``POST /v1/responses``,
``GET /v1/models``) and the Anthropic Messages format (``POST /v1/messages``), streamed
(server-sent events) or not. For each call the gateway

1. checks the model against the grant (``policy.models``): an ungranted model answers the
   provider's own 403 error and records ``model.denied``; then every field of the body (and
   the Anthropic headers) against the wire format's allow list (``gateway_fields``): a field
   that would make the provider bill past the tokens or fetch for the guest is a 400 in the
   provider's shape, naming it;
2. holds the worst case (the request's bytes / 3 as input tokens, more for media and tools,
   plus ``max_tokens`` at the price book's rates) inside the run's budget before anything is
   sent, ``max_tokens`` lowered
   to what the budget still covers; when not even 64 output tokens fit, the call answers the
   provider's quota error and the run stops ``budget_exhausted`` (every stream cut);
3. forwards the call (``stream_options.include_usage`` asked for, so a stream reports usage),
   relays the answer with the key redacted, and
4. settles the hold to the usage the provider reported, also for a stream the client hung up
   on (the gateway reads the rest of the upstream's answer for its usage), writes the charge
   (kind ``model``) and a ``model.called`` event, and keeps the turn for ``ephemeral record``;
   usage past the hold is charged (within the reservation), alarmed (``budget.overrun``) and
   ends the run.

``replay/NAME`` grants are served from the cassette's turns, in either format.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

import httpx

from ephemeral import errors
from ephemeral.broker.gateway_fields import Refused, check_body, check_headers
from ephemeral.broker.gateway_wire import (
    CHAT,
    MESSAGES,
    RESPONSES,
    StreamFolder,
    assistant_turns,
    event_end,
    max_tokens,
    read_capped,
    render,
    render_stream,
    response_head,
    turn_of,
    usage_of,
    write_json,
)
from ephemeral.broker.redact import REDACTED, Redactor
from ephemeral.lifecycle import StopRun, TerminationReason
from ephemeral.providers.base import Usage
from ephemeral.providers.replay import PREFIX as REPLAY_PREFIX
from ephemeral.providers.replay import cassette_path, load_cassette

if TYPE_CHECKING:
    from ephemeral.broker.context import BrokerContext
    from ephemeral.broker.egress import Egress, GuestStream, Head
    from ephemeral.money.budget import RunBudget
    from ephemeral.money.pricing import PriceBook
    from ephemeral.settings import Settings
    from ephemeral.store import Store

log = logging.getLogger("ephemeral.broker")

MODEL_HOST: Final = "model.internal"
PLACEHOLDER_KEY: Final = "ephemeral-gateway"  # what the sandbox holds instead of a key
DEFAULT_MAX_TOKENS: Final = 4096  # when the request names none (and at most what fits)
MIN_CALL_TOKENS: Final = 64  # when not even this many fit, the budget is spent
# Held per image or document beyond its bytes: a small image can cost more tokens than its
# bytes / 3 (about 1,600 at most on Anthropic, 2,500 on OpenAI's patch-priced models).
MEDIA_TOKENS: Final = 2_500
TOOLS_TOKENS: Final = 512  # the tool-use system prompt a provider adds (Anthropic: 313-346)
REQUEST_CAP: Final = 8 << 20
EVENT_CAP: Final = 1 << 20  # one server-sent event
MAX_SECONDS: Final = 600.0
MODEL_PREFIXES: Final = ("openai", "openrouter", "anthropic", "replay")

ROUTES: Final = {
    "/v1/chat/completions": CHAT,
    "/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES,
}
_RELAYED_HEADERS: Final = ("content-type", "retry-after", "retry-after-ms", "request-id")


class Charges(Protocol):
    """Where a call's money goes: the owner's budget and ledger (``attach.WebCharges``)."""

    store: Store
    run_id: str
    budget: RunBudget
    error: str | None  # set when a charge was not written: the owner stops

    def track(self, task: asyncio.Task[None]) -> None:
        """Have the owner wait for ``task`` before it settles."""
        ...


class _Answer(Exception):
    """An answer the gateway gives itself (an error in the provider's shape)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


def env() -> dict[str, str]:
    """The variables every command of a sandbox with a model grant gets."""
    base = f"http://{MODEL_HOST}"
    return {
        "OPENAI_BASE_URL": f"{base}/v1",
        "OPENAI_API_BASE": f"{base}/v1",
        "ANTHROPIC_BASE_URL": base,
        "OPENAI_API_KEY": PLACEHOLDER_KEY,
        "ANTHROPIC_API_KEY": PLACEHOLDER_KEY,
    }


def check_grants(models: list[str], price_book: PriceBook, settings: Settings) -> None:
    """Admission: every granted model has a provider this host serves and a price."""
    for i, model in enumerate(models):
        prefix = model.partition("/")[0]
        where = f"models[{i}]"
        if prefix not in MODEL_PREFIXES:
            raise errors.InvalidRequest.field(
                where, f"unknown provider {prefix!r} (providers: {', '.join(MODEL_PREFIXES)})"
            )
        try:
            price_book.check_model(model)
            if prefix == "replay":
                cassette_path(settings.cassettes_dir, model.removeprefix(REPLAY_PREFIX))
        except errors.UnknownModel as exc:
            raise errors.InvalidRequest.field(where, exc.detail) from None


def _error(api: str, status: int, kind: str, message: str, code: str | None = None) -> _Answer:
    if api == MESSAGES:
        return _Answer(status, {"type": "error", "error": {"type": kind, "message": message}})
    body = {"message": message, "type": kind, "param": None, "code": code}
    return _Answer(status, {"error": body})


def _denied(api: str, message: str) -> _Answer:
    if api == MESSAGES:
        return _error(api, 403, "permission_error", message)
    return _error(api, 403, "invalid_request_error", message, "model_not_found")


def _no_budget(api: str, message: str) -> _Answer:
    if api == MESSAGES:
        return _error(api, 402, "billing_error", message)
    return _error(api, 429, "insufficient_quota", message, "insufficient_quota")


def _bad(api: str, message: str) -> _Answer:
    return _error(api, 400, "invalid_request_error", message)


def _refused(api: str, provider: str, refused: Refused) -> _Answer:
    """A field the gateway does not forward, as the provider answers a bad field: OpenAI's
    ``param`` and ``code``, OpenRouter's ``{code, message}``, Anthropic's ``invalid_request_error``
    (whose messages also start with the field's path)."""
    message = str(refused)
    if provider == "openrouter" and api != MESSAGES:
        return _Answer(400, {"error": {"code": 400, "message": message}})
    if api == MESSAGES:
        return _error(api, 400, "invalid_request_error", message)
    code = "unknown_parameter" if refused.unknown else "unsupported_value"
    answer = _error(api, 400, "invalid_request_error", message, code)
    answer.body["error"]["param"] = refused.field
    return answer


@dataclass
class _Call:
    """One model call in flight: what was asked, what is held, what came back."""

    api: str
    grant: str  # the granted model (provider/name)
    name: str  # the provider's model name
    body: dict[str, Any]
    stream: bool
    max_tokens: int
    input_estimate: int
    hold: int = 0
    status: int | None = None
    usage: Usage | None = None
    final: bool = False  # the provider reported the call's whole usage
    cut: str | None = None
    turn: dict[str, Any] | None = None  # the assistant turn, for ephemeral record
    started: float = field(default_factory=time.monotonic)
    overrun: bool = False  # the provider reported more than was held


class Gateway:
    """One sandbox's model gateway (made by ``attach.start_egress`` when models are granted)."""

    def __init__(
        self,
        ctx: BrokerContext,
        *,
        grants: list[str],
        settings: Settings,
        price_book: PriceBook,
        charges: Charges,
    ) -> None:
        self.ctx = ctx
        self.grants = list(dict.fromkeys(grants))
        self.settings = settings
        self.price_book = price_book
        self.charges = charges
        self.calls = 0
        self.usage = Usage()
        self.turns: list[dict[str, Any]] = []
        self._client: httpx.AsyncClient | None = None
        self._saving = False  # a transcript write is in flight
        self._dirty = False  # turns came since it started
        self._secrets = [
            s.get_secret_value()
            for s in (
                settings.openai_api_key,
                settings.openrouter_api_key,
                settings.anthropic_api_key,
            )
            if s is not None and s.get_secret_value()
        ]
        # Built once: every answer and every event of a stream passes through it.
        self._redaction = Redactor(self._secrets)._pattern

    def _redact(self, data: bytes) -> bytes:
        """``data`` with every form of each provider key replaced (``broker.redact``)."""
        return data if self._redaction is None else self._redaction.sub(REDACTED, data)

    async def _save_turns(self) -> None:
        """Write the transcript; calls settling while a write is in flight share the next one,
        so a long run does not rewrite its whole transcript once per call."""
        if self._saving:
            self._dirty = True
            return
        self._saving = True
        try:
            while True:
                self._dirty = False
                await self.charges.store.transcripts.save(self.charges.run_id, list(self.turns))
                if not self._dirty:
                    return
        finally:
            self._saving = False

    # -- routing -------------------------------------------------------------------------------
    @staticmethod
    def serves(head: Head, host: str | None) -> bool:
        """Whether a request is the gateway's: to ``model.internal``, or in origin form (a
        client that ignores proxy variables calling the forwarder itself)."""
        if head.method == "CONNECT":
            return False
        return head.target.startswith("/") or (host or "").lower() == MODEL_HOST

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    def _http(self) -> httpx.AsyncClient:
        # One client per sandbox, on the egress loop: a new connection per call would add a
        # TCP (and TLS) handshake to every call.
        if self._client is None:
            self._client = httpx.AsyncClient(
                trust_env=False, follow_redirects=False, timeout=httpx.Timeout(MAX_SECONDS)
            )
        return self._client

    # -- one request ---------------------------------------------------------------------------
    async def handle(self, stream: GuestStream, head: Head, egress: Egress) -> None:
        target = head.target
        if not target.startswith("/"):
            target = "/" + target.split("://", 1)[-1].partition("/")[2]
        path = target.split("?", 1)[0].rstrip("/")
        if path.startswith("/v1") is False and path in ("/chat/completions", "/responses"):
            path = "/v1" + path  # OPENAI_API_BASE without /v1 (older clients)
        anthropic_client = head.header("anthropic-version") is not None or (
            head.header("x-api-key") is not None and head.header("authorization") is None
        )
        api = ROUTES.get(path, MESSAGES if anthropic_client else CHAT)
        try:
            if head.method == "GET" and path == "/v1/models":
                await write_json(stream, 200, self._models(anthropic_client))
                return
            if path not in ROUTES:
                raise _error(api, 404, "not_found_error", f"no route {head.method} {path[:200]}")
            if head.method != "POST":
                raise _error(api, 405, "invalid_request_error", f"{path} takes POST")
            from ephemeral.broker.egress import _Cut, _Refusal

            try:
                raw = await egress._request_body(stream, head)
            except (_Refusal, _Cut, TimeoutError) as exc:  # framing the proxy refuses
                raise _bad(api, str(exc) or "bad request body") from None
            if len(raw) > REQUEST_CAP:
                raise _error(api, 413, "request_too_large", f"body over {REQUEST_CAP} bytes")
            call = await self._admit(api, raw, head)
        except _Answer as answer:
            with contextlib.suppress(ConnectionError):
                await write_json(stream, answer.status, answer.body)
            if answer.status in (402, 429):  # the budget is spent: the run ends
                await egress._stop(
                    StopRun(TerminationReason.BUDGET_EXHAUSTED, "model calls used up the budget")
                )
            return
        try:
            await self._run(call, stream, head)
            await stream.close()  # the client's wait ends with the answer, not the bookkeeping
        finally:
            # Settled even when this handler is cancelled (the owner ending mid-call: the
            # provider may bill what it already did), before the owner's books close.
            settle = asyncio.create_task(self._settle(call, egress))
            self.charges.track(settle)
            await asyncio.shield(settle)
        if not call.overrun:  # (an overrun stopped the run already)
            await self._stop_if_spent(egress)

    async def _stop_if_spent(self, egress: Egress) -> None:
        """Not even a small call fits any granted model: the run (or session) ends."""
        if self._exhausted():
            await egress._stop(
                StopRun(
                    TerminationReason.BUDGET_EXHAUSTED,
                    "model calls used up the budget",
                )
            )

    def _models(self, anthropic_client: bool) -> dict[str, Any]:
        if anthropic_client:
            data = [
                {"type": "model", "id": m, "display_name": m, "created_at": "2026-01-01T00:00:00Z"}
                for m in self.grants
            ]
            first = data[0]["id"] if data else None
            return {"data": data, "has_more": False, "first_id": first, "last_id": first}
        return {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": m.partition("/")[0]}
                for m in self.grants
            ],
        }

    def _grant_for(self, api: str, requested: str) -> str | None:
        """The granted model a request names: the grant itself, or its provider name."""
        fits = [
            g
            for g in self.grants
            if g.startswith(REPLAY_PREFIX) or (api == MESSAGES) == g.startswith("anthropic/")
        ]
        for g in fits:
            if requested == g:
                return g
        for g in fits:
            if requested == g.partition("/")[2]:
                return g
        return None

    async def _admit(self, api: str, raw: bytes, head: Head) -> _Call:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise _bad(api, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise _bad(api, "the body is not a JSON object")
        requested = body.get("model")
        if not isinstance(requested, str) or not requested:
            raise _bad(api, "model: a model name is required")
        grant = self._grant_for(api, requested)
        if grant is None:
            other = next((g for g in self.grants if requested in (g, g.partition("/")[2])), None)
            if other is not None:
                served = (
                    "/v1/messages" if other.startswith("anthropic/") else "/v1/chat/completions"
                )
                reason = f"model {requested!r} is served at {served}, not {api}"
            else:
                granted = ", ".join(self.grants)
                reason = f"model {requested!r} is not granted to this sandbox (granted: {granted})"
            await self.ctx.emit(
                "model.denied",
                {"model": requested[:200], "api": api, "reason": reason[:500]},
            )
            raise _denied(api, reason)
        provider = grant.partition("/")[0]
        try:
            check_headers(api, head.header)
            found = check_body(api, provider, body)
        except Refused as refused:
            await self.ctx.emit(
                "model.denied",
                {
                    "model": requested[:200],
                    "api": api,
                    "reason": str(refused)[:500],
                    "field": refused.field[:200],
                },
            )
            raise _refused(api, provider, refused) from None
        stream = body.get("stream") is True
        max_field, asked = max_tokens(api, body)
        if asked is not None and (
            isinstance(asked, bool) or not isinstance(asked, int) or asked < 1
        ):
            raise _bad(api, f"{max_field}: must be a positive integer")
        estimate = len(raw) // 3 + 16 + found.media * MEDIA_TOKENS
        estimate += TOOLS_TOKENS if found.tools else 0
        call = _Call(
            api=api,
            grant=grant,
            name=grant.partition("/")[2],
            body=body,
            stream=stream,
            max_tokens=asked or DEFAULT_MAX_TOKENS,
            input_estimate=estimate,
        )
        budget = self.charges.budget
        room = budget.remaining() - self.price_book.worst_case(grant, estimate, 0)
        out_price = self.price_book.model_price(grant).output_per_mtok
        fit = call.max_tokens if out_price == 0 else max(0, room) * 1_000_000 // out_price
        if fit < call.max_tokens:
            # Like our own loop: the call gets the output the budget can still cover (the
            # answer may end at "length"); when not even a small one fits, the budget is spent.
            if fit < MIN_CALL_TOKENS:
                left = budget.remaining()
                raise _no_budget(
                    api,
                    f"the run's budget cannot cover this call ({left} micro-dollars left; "
                    f"{max_field}={call.max_tokens} could cost "
                    f"{self.price_book.worst_case(grant, estimate, call.max_tokens)})",
                )
            call.max_tokens = int(fit)
        # The provider must not go past what is held.
        body[max_field] = call.max_tokens
        call.hold = self.price_book.worst_case(grant, estimate, call.max_tokens)
        budget.charged["model_micros"] += call.hold
        return call

    def _exhausted(self) -> bool:
        """Whether not even a small call fits any granted model any more."""
        left = self.charges.budget.remaining()
        return all(self.price_book.worst_case(g, 16, MIN_CALL_TOKENS) > left for g in self.grants)

    # -- the call ------------------------------------------------------------------------------
    async def _run(self, call: _Call, stream: GuestStream, head: Head) -> None:
        timeout = max(0.1, min(MAX_SECONDS, self.ctx.time_left()))
        try:
            async with asyncio.timeout(timeout):
                if call.grant.startswith(REPLAY_PREFIX):
                    await self._replay(call, stream)
                else:
                    await self._forward(call, stream, head)
        except TimeoutError:
            call.cut = call.cut or "no answer within the run's time"
            if call.status is None:
                with contextlib.suppress(ConnectionError):
                    await write_json(stream, 504, _error(call.api, 504, "api_error", call.cut).body)
        except httpx.HTTPError as exc:
            call.cut = call.cut or f"upstream failed: {type(exc).__name__}"
            if call.status is None:
                call.status = 502
                with contextlib.suppress(ConnectionError):
                    body = _error(call.api, 502, "api_error", "the model API did not answer")
                    await write_json(stream, 502, body.body)

    def _upstream(self, call: _Call, head: Head) -> tuple[str, dict[str, str], str | None]:
        prefix = call.grant.partition("/")[0]
        s = self.settings
        headers = {"content-type": "application/json", "user-agent": "ephemeral-gateway"}
        if prefix == "anthropic":
            key = s.anthropic_api_key.get_secret_value() if s.anthropic_api_key else None
            headers["anthropic-version"] = head.header("anthropic-version") or "2023-06-01"
            beta = head.header("anthropic-beta")
            if beta:
                headers["anthropic-beta"] = beta
            if key:
                headers["x-api-key"] = key
            return s.anthropic_base_url.rstrip("/") + "/v1/messages", headers, key
        secret = s.openrouter_api_key if prefix == "openrouter" else s.openai_api_key
        base = s.openrouter_base_url if prefix == "openrouter" else s.openai_base_url
        key = secret.get_secret_value() if secret else None
        if key:
            headers["authorization"] = f"Bearer {key}"
        suffix = "/chat/completions" if call.api == CHAT else "/responses"
        return base.rstrip("/") + suffix, headers, key

    async def _forward(self, call: _Call, stream: GuestStream, head: Head) -> None:
        url, headers, _ = self._upstream(call, head)
        body = dict(call.body, model=call.name)
        asked_usage = True
        if call.stream and call.api == CHAT:
            options = body.get("stream_options")
            options = dict(options) if isinstance(options, dict) else {}
            asked_usage = options.get("include_usage") is True
            body["stream_options"] = {**options, "include_usage": True}
        payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        client = self._http()
        request = client.build_request("POST", url, content=payload, headers=headers)
        response = await client.send(request, stream=True)
        try:
            call.status = response.status_code
            kept = {k: v for k in _RELAYED_HEADERS if (v := response.headers.get(k)) is not None}
            sse = "text/event-stream" in response.headers.get("content-type", "")
            if not (call.stream and sse and call.status == 200):
                raw = await read_capped(response)
                await self._reply_whole(call, stream, call.status, kept, raw)
                return
            await self._relay_stream(call, stream, kept, response.aiter_raw(), asked_usage)
        finally:
            await response.aclose()

    async def _reply_whole(
        self, call: _Call, stream: GuestStream, status: int, headers: dict[str, str], raw: bytes
    ) -> None:
        if status == 200:
            try:
                doc = json.loads(raw)
            except (ValueError, RecursionError):
                doc = None
            if isinstance(doc, dict):
                call.usage = usage_of(call.api, doc)
                call.final = call.usage is not None
                call.turn = turn_of(call.api, doc)
        shown = self._redact(raw)
        with contextlib.suppress(ConnectionError):
            await stream.write(response_head(status, headers, len(shown)) + shown)

    async def _relay_stream(
        self,
        call: _Call,
        stream: GuestStream,
        headers: dict[str, str],
        chunks: Any,
        asked_usage: bool,
    ) -> None:
        """Relay server-sent events one whole event at a time (each redacted on its own),
        reading usage from them; after a client hang-up, read on for the usage alone."""
        gone = False
        with contextlib.suppress(ConnectionError):
            sse_headers = {**headers, "content-type": "text/event-stream"}
            await stream.write(response_head(200, sse_headers, None))
        if stream.closed:
            gone = True
        folder = StreamFolder(call.api)
        buf = b""
        async for chunk in chunks:
            buf += chunk
            out = bytearray()
            while True:
                end = event_end(buf)
                if end < 0:
                    if len(buf) > EVENT_CAP:
                        call.cut = "an event larger than the gateway's cap"
                        raise httpx.ReadError(call.cut)
                    break
                event, buf = buf[:end], buf[end:]
                keep = folder.feed(event)
                if keep or asked_usage:
                    out += event
            if out and not gone:
                data = self._redact(bytes(out))
                try:
                    await stream.write(b"%x\r\n%s\r\n" % (len(data), data))
                except ConnectionError:
                    gone = True
            if gone and call.cut is None:
                call.cut = "the client hung up; the rest was read for its usage"
        if buf and not gone:
            with contextlib.suppress(ConnectionError):
                data = self._redact(buf)
                await stream.write(b"%x\r\n%s\r\n" % (len(data), data))
        if not gone:
            with contextlib.suppress(ConnectionError):
                await stream.write(b"0\r\n\r\n")
        call.usage, call.final = folder.usage, folder.final
        call.turn = folder.turn()

    # -- replay --------------------------------------------------------------------------------
    async def _replay(self, call: _Call, stream: GuestStream) -> None:
        name = call.grant.removeprefix(REPLAY_PREFIX)
        try:
            cassette = load_cassette(cassette_path(self.settings.cassettes_dir, name))
        except errors.UnknownModel as exc:
            call.status = 500
            await write_json(stream, 500, _error(call.api, 500, "api_error", exc.detail).body)
            return
        index = assistant_turns(call.api, call.body)
        if index >= len(cassette.turns):
            call.status = 500
            why = f"{call.grant}: cassette exhausted after {len(cassette.turns)} turns"
            await write_json(stream, 500, _error(call.api, 500, "api_error", why).body)
            return
        turn = cassette.turns[index]
        usage = turn.usage.model_copy()
        usage.output_tokens = min(usage.output_tokens, call.max_tokens)
        call.status, call.usage, call.final = 200, usage, True
        message = turn.message
        call.turn = {
            "message": message.model_dump(),
            "usage": usage.model_dump(),
            "latency_ms": turn.latency_ms,
        }
        text = message.content
        calls = [(c.id, c.name, c.arguments) for c in message.tool_calls]
        model = cassette.model.partition("/")[2]
        if not call.stream:
            await write_json(stream, 200, render(call.api, text, calls, usage, model))
            return
        events = render_stream(call.api, text, calls, usage, model, call.body)
        await stream.write(response_head(200, {"content-type": "text/event-stream"}, None))
        for event in events:
            try:
                await stream.write(b"%x\r\n%s\r\n" % (len(event), event))
            except ConnectionError:
                call.cut = "the client hung up"
                return
        await stream.write(b"0\r\n\r\n")

    # -- settle --------------------------------------------------------------------------------
    def _overrun(self, call: _Call, reported: int, charged: int) -> dict[str, Any]:
        usage = call.usage or Usage()
        return {
            "model": call.grant,
            "api": call.api,
            "held_micros": call.hold,
            "reported_micros": reported,
            "charged_micros": charged,
            "unbilled_micros": reported - charged,
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cached_input_tokens": usage.cached_input_tokens,
        }

    async def _settle(self, call: _Call, egress: Egress) -> None:
        """Release the hold, charge what the provider reported (the hold when it reported
        nothing whole, nothing for an error it answered), record the call.

        A provider reporting more than was held is charged that, as far as the run's
        reservation goes (the org never pays past ``max_cost_micros``), with a ``budget.overrun``
        event in the charge's transaction, and the run ends ``budget_exhausted``: the hold was
        wrong, so nothing more is spent on this run's money."""
        budget = self.charges.budget
        overrun: tuple[str, dict[str, Any]] | None = None
        if call.status is not None and call.status >= 400 and not call.final:
            cost = 0
        elif call.final and call.usage is not None:
            cost = self.price_book.model_cost(call.grant, call.usage)
            if cost > call.hold:
                # What the run still has beyond this hold (other calls' holds, web and model
                # charges counted; compute is charged last, capped at what is left).
                room = call.hold + max(0, budget.reserved_micros - budget.non_compute_spent())
                reported, cost = cost, min(cost, room)
                call.overrun = True
                overrun = ("budget.overrun", self._overrun(call, reported, cost))
                log.error(
                    "%s: ALARM: %s reported usage costing %d micros against a hold of %d; "
                    "charged %d, %d beyond the run's reservation not charged",
                    self.charges.run_id,
                    call.grant,
                    reported,
                    call.hold,
                    cost,
                    reported - cost,
                )
        else:
            cost = call.hold  # cut before the provider said what it used: the most it could be
        budget.charged["model_micros"] += cost - call.hold
        if call.overrun:
            # No await between the budget moving and the stop being set (``_stop`` sets it
            # before its first await): a concurrent settle sees the new budget, and the agent's
            # watch sees this stop, not the compute deadline the charge brought forward.
            stop = StopRun(
                TerminationReason.BUDGET_EXHAUSTED,
                "a model call cost more than was held for it (budget.overrun)",
            )
            try:
                await egress._stop(stop)
            except Exception as exc:  # noqa: BLE001 - the charge below must still be written
                log.error("%s: the overrun did not stop the run: %s", self.charges.run_id, exc)
        usage = call.usage or Usage()
        self.calls += 1
        n = self.calls
        self.usage = Usage(
            input_tokens=self.usage.input_tokens + usage.input_tokens,
            output_tokens=self.usage.output_tokens + usage.output_tokens,
            cached_input_tokens=self.usage.cached_input_tokens + usage.cached_input_tokens,
        )
        latency = int((time.monotonic() - call.started) * 1000)
        data: dict[str, Any] = {
            "model": call.grant,
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cached_input_tokens": usage.cached_input_tokens,
            "cost_micros": cost,
            "reserved_micros": call.hold,
            "latency_ms": latency,
            "stream": call.stream,
            "api": call.api,
            "status": call.status,
            "via": "gateway",
        }
        if call.cut:
            data["cut"] = call.cut
        try:
            if cost:
                key = f"{self.charges.run_id}:gateway:{n}"
                await self.charges.store.money.charge(
                    self.charges.run_id, "model", cost, key=key, event=overrun
                )
            elif overrun is not None:
                await self.ctx.emit(*overrun)
            await self.ctx.emit("model.called", data)
            if call.turn is not None and not self.ctx.policy.zero_data_retention:
                call.turn["latency_ms"] = call.turn.get("latency_ms") or latency
                turn = call.turn
                if self._secrets:  # a model can say a key too (the provider echoing it back)
                    turn = json.loads(self._redact(json.dumps(turn).encode()))
                self.turns.append(turn)
                await self._save_turns()
        except Exception as exc:  # noqa: BLE001 - recorded; the owner stops at its next step
            log.error("%s: a model charge was not written: %s", self.charges.run_id, exc)
            self.charges.error = type(exc).__name__
