"""The pages: a run (live), a recorded sample replayed, the playground, sign-in.

Server-rendered with Jinja2; each timeline row is rendered by one macro, both for the first
paint and for the rows the live stream adds, so the page and the stream cannot disagree.

Signing in stores the member key in an HttpOnly, ``SameSite=Strict`` session cookie: page
scripts never see the key, and ``/v1`` ignores the cookie (Bearer only).
"""

from __future__ import annotations

import contextlib
import json
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from pydantic import ValidationError

from ephemeral import errors
from ephemeral.api import samples, sse, view
from ephemeral.api.auth import PAGE_COOKIE, get_runtime, page_principal
from ephemeral.api.problems import field_name
from ephemeral.api.runs import base_url, body_hash
from ephemeral.events import Event
from ephemeral.models import default_model, usable_models
from ephemeral.money.amounts import parse_usd, usd
from ephemeral.policy import RunRequest
from ephemeral.runview import run_object
from ephemeral.store import Principal
from ephemeral.timeline import COMMAND_EVENTS

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"
PLAYGROUND_FIELDS = {"max_cost_micros": "budget", "timeout_seconds": "timeout"}

pages = APIRouter(include_in_schema=False)
env = Environment(
    loader=FileSystemLoader(TEMPLATES_DIR),
    autoescape=True,
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
env.globals["usd"] = usd
env.globals["COMMAND_EVENTS"] = COMMAND_EVENTS
env.filters["tojson_attr"] = lambda v: json.dumps(v, ensure_ascii=False)


def _model_choices(request: Request) -> dict[str, Any]:
    """What the playground's model field offers: GET /v1/models, and the default or None."""
    runtime = get_runtime(request)
    return {
        "models": usable_models(runtime.settings, runtime.price_book),
        "default_model": default_model(runtime.settings),
    }


def render(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    context.setdefault("signed_in", None)
    html = env.get_template(name).render(request_path=request.url.path, **context)
    return HTMLResponse(
        html,
        status_code=status,
        headers={
            "Content-Security-Policy": (
                "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
            ),
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "same-origin",
        },
    )


def _macros() -> Any:
    return env.get_template("_macros.html.j2").module


def _safe_next(target: str | None) -> str:
    """Only same-site paths: ``/runs/…``, never ``//evil`` or ``https://…``."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    host = request.headers.get("host", "")
    return urlsplit(origin).netloc == host


async def _form(request: Request) -> dict[str, str]:
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype != "application/x-www-form-urlencoded":
        raise errors.UnsupportedMediaType("forms are sent as application/x-www-form-urlencoded")
    raw = (await request.body()).decode("utf-8", errors="replace")
    return {k: v[-1] for k, v in parse_qs(raw, keep_blank_values=True).items()}


def _login_redirect(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/login?next={quote(target)}", status_code=303)


def _set_key_cookie(response: Response, request: Request, key: str) -> None:
    response.set_cookie(
        PAGE_COOKIE,
        key,
        httponly=True,
        samesite="strict",
        path="/",
        secure=request.url.scheme == "https",
    )


# -- index and sign-in ---------------------------------------------------------------------------


@pages.get("/")
async def index(request: Request) -> Response:
    runtime = get_runtime(request)
    who = await page_principal(request)
    runs: list[dict[str, Any]] = []
    if who is not None:
        rows, _ = await runtime.store.runs.list(who.org_id, limit=20)
        runs = [run_object(r, base_url(request)) for r in rows]
    return render(request, "index.html.j2", signed_in=who, runs=runs, headline=view.headline)


@pages.get("/login")
async def login_form(request: Request, next: str = "/") -> Response:
    return render(request, "login.html.j2", next=_safe_next(next), error=None)


@pages.post("/login")
async def login(request: Request) -> Response:
    if not _same_origin(request):
        return render(
            request,
            "error.html.j2",
            403,
            title="Forbidden",
            detail="cross-site form submission refused",
        )
    form = await _form(request)
    target = _safe_next(form.get("next"))
    key = form.get("api_key", "").strip()
    try:
        await get_runtime(request).store.keys.authenticate(key)
    except errors.Unauthorized as exc:
        return render(request, "login.html.j2", 401, next=target, error=exc.detail)
    response = RedirectResponse(target, status_code=303)
    _set_key_cookie(response, request, key)
    return response


@pages.post("/logout")
async def logout(request: Request) -> Response:
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(PAGE_COOKIE, path="/")
    return response


# -- the run page ---------------------------------------------------------------------------------


def _summary_context(run: dict[str, Any]) -> dict[str, Any]:
    return {
        "run": run,
        "headline": view.headline(run),
        "money": view.money_line(run),
        "status_label": view.STATUS_LABELS.get(run["status"], run["status"]),
    }


@pages.get("/runs/{run_id}")
async def run_page(request: Request, run_id: str) -> Response:
    runtime = get_runtime(request)
    who = await page_principal(request)
    if who is None:
        return _login_redirect(request)
    try:
        row = await runtime.store.runs.get(run_id, who.org_id)
    except errors.NotFound as exc:
        return render(
            request, "error.html.j2", 404, title="Not found", detail=exc.detail, signed_in=who
        )
    events = await runtime.store.events.list(run_id)
    t0 = events[0].at if events else None
    run = run_object(row, base_url(request))
    settled = bool(events) and events[-1].type == "run.settled"
    return render(
        request,
        "run.html.j2",
        signed_in=who,
        **_summary_context(run),
        rows=[view.timeline_row(e, t0) for e in events],
        grading=view.grading(row.labels or {}, events),
        permissions=view.permission_rows(row.policy, runtime.settings.retention_days),
        prompt=row.prompt,
        live=not settled,
        last_seq=events[-1].seq if events else 0,
        t0=t0 or "",
    )


@pages.get("/runs/{run_id}/live")
async def run_live(request: Request, run_id: str, after: sse.After = 0, t0: str = "") -> Response:
    """The run page's live stream: each event as the HTML row the page would have rendered."""
    runtime = get_runtime(request)
    who = await page_principal(request)
    if who is None:
        raise errors.Unauthorized("sign in to follow this run")
    await runtime.store.runs.get(run_id, who.org_id)
    start = max(after, sse.parse_last_event_id(request.headers.get("last-event-id")) or 0)
    macros = _macros()
    base = base_url(request)
    first: str | None = None  # the run's first event time, for the rows' "+1.2 s" offsets
    if t0:
        with contextlib.suppress(ValueError):
            view.parse_at(t0)
            first = t0

    async def rows() -> Any:
        async for ev in runtime.events(run_id, start, follow=True):
            yield ev

    async def extra(ev: Event) -> dict[str, Any]:
        if ev.type != "run.settled" and not (
            ev.type.startswith("run.") and ev.type not in ("run.queued", "run.output")
        ):
            return {}
        run = run_object(await runtime.store.runs.get(run_id), base)
        return {"summary_html": str(macros.summary(**_summary_context(run)))}

    # Rendering needs the store (for the settled summary), so events are mapped here, not in sse.
    async def rendered() -> Any:
        nonlocal first
        async for ev in rows():
            first = first or ev.at
            payload = {
                "seq": ev.seq,
                "type": ev.type,
                "html": str(macros.timeline_row(view.timeline_row(ev, first))),
            }
            payload.update(await extra(ev))
            yield Event(seq=ev.seq, run_id=ev.run_id, type="page.row", at=ev.at, data=payload)

    return StreamingResponse(
        sse.stream(rendered(), lambda e: sse.frame(e.data, id=e.seq)),
        media_type="text/event-stream",
        headers=sse.SSE_HEADERS,
    )


# -- samples --------------------------------------------------------------------------------------


@pages.get("/samples/{name}")
async def sample_page(request: Request, name: str) -> Response:
    runtime = get_runtime(request)
    try:
        sample = samples.load_sample(runtime.settings, name)
    except errors.NotFound as exc:
        return render(request, "error.html.j2", 404, title="Not found", detail=exc.detail)
    events = sample.events
    t0 = events[0].at
    folded = _sample_run(sample)
    body = view.request_json(sample.prompt, sample.policy)
    return render(
        request,
        "sample.html.j2",
        signed_in=await page_principal(request),
        sample=sample,
        **_summary_context(folded),
        rows=[view.timeline_row(e, t0) for e in events],
        permissions=view.permission_rows(sample.policy, runtime.settings.retention_days),
        curl=view.CURL,
        request_json=json.dumps(body, indent=2, ensure_ascii=False),
        duration_ms=view.timeline_row(events[-1], t0)["offset_ms"],
    )


def _sample_run(sample: samples.Sample) -> dict[str, Any]:
    """A run object for the recorded sample, folded from its events alone."""
    from ephemeral.runview import fold_events

    state = fold_events(sample.events)
    breakdown = state["cost"]["breakdown"] or {}
    return {
        "id": sample.run_id,
        "status": state["status"],
        "model": sample.model,
        "cost": {
            **state["cost"],
            "breakdown": {
                "model_micros": int(breakdown.get("model_micros", 0)),
                "web_micros": int(breakdown.get("web_micros", 0)),
                "compute_micros": int(breakdown.get("compute_micros", 0)),
            },
        },
        "policy": sample.policy,
        "usage": state["usage"],
        "isolation": state["isolation"],
        "termination": {"reason": state["reason"], "detail": None} if state["reason"] else None,
    }


# -- playground -----------------------------------------------------------------------------------


def _playground_defaults(request: Request, sample_name: str | None) -> dict[str, Any]:
    values: dict[str, Any] = {
        "prompt": "",
        "model": "",
        "web": False,
        "shell": True,
        "timeout": "120",
        "budget": "0.04",
    }
    if sample_name:
        try:
            sample = samples.load_sample(get_runtime(request).settings, sample_name)
        except errors.EphemeralError:
            return values
        p = sample.policy
        values.update(
            prompt=sample.prompt,
            model=sample.model,  # its replay answers this prompt; a blank model may have none
            web=bool(p.get("web")),
            shell=bool(p.get("shell")),
            timeout=str(p.get("timeout_seconds", 120)),
            budget=usd(p.get("max_cost_micros")).lstrip("$"),
        )
    return values


@pages.get("/playground")
async def playground(request: Request, sample: str | None = None) -> Response:
    who = await page_principal(request)
    return render(
        request,
        "playground.html.j2",
        signed_in=who,
        values=_playground_defaults(request, sample),
        **_model_choices(request),
        errors={},
        error=None,
        token=secrets.token_hex(16),
    )


def _request_from_form(form: dict[str, str]) -> RunRequest:
    timeout = form.get("timeout", "120").strip()
    if not timeout.lstrip("-").isdigit():
        raise errors.InvalidRequest.field("timeout", "must be a whole number of seconds")
    try:
        return RunRequest(
            prompt=form.get("prompt", ""),
            model=form.get("model", "").strip() or None,
            web=form.get("web") == "on",
            shell=form.get("shell") == "on",
            timeout_seconds=int(timeout),
            max_cost_micros=parse_usd(form.get("budget", ""), field="budget"),
        )
    except ValidationError as exc:
        items = []
        for err in exc.errors():
            name = field_name(err["loc"])
            items.append(
                {
                    "field": PLAYGROUND_FIELDS.get(name, name),
                    "message": str(err["msg"]).removeprefix("Value error, "),
                }
            )
        raise errors.InvalidRequest(
            "; ".join(f"{i['field']}: {i['message']}" for i in items), errors=items
        ) from exc


@pages.post("/playground")
async def playground_submit(request: Request) -> Response:
    if not _same_origin(request):
        return render(
            request,
            "error.html.j2",
            403,
            title="Forbidden",
            detail="cross-site form submission refused",
        )
    runtime = get_runtime(request)
    form = await _form(request)
    values = {
        "prompt": form.get("prompt", ""),
        "model": form.get("model", ""),
        "web": form.get("web") == "on",
        "shell": form.get("shell") == "on",
        "timeout": form.get("timeout", ""),
        "budget": form.get("budget", ""),
    }
    token = form.get("token") or secrets.token_hex(16)
    who: Principal | None = await page_principal(request)
    new_key = form.get("api_key", "").strip()

    def again(status: int, error: str, field_errors: dict[str, str] | None = None) -> Response:
        return render(
            request,
            "playground.html.j2",
            status,
            signed_in=who,
            values=values,
            **_model_choices(request),
            errors=field_errors or {},
            error=error,
            token=token,
        )

    try:
        if new_key:
            who = await runtime.store.keys.authenticate(new_key)
        if who is None:
            raise errors.InvalidRequest.field("api_key", "paste a member key to start a run")
        run_request = _request_from_form(form)
        row, _ = await runtime.submit(
            who.org_id,
            run_request,
            idempotency_key=f"playground:{token[:64]}",
            body_hash=body_hash(run_request),
            labels={"source": "playground"},
        )
    except errors.Unauthorized as exc:
        return again(401, exc.detail, {"api_key": exc.detail})
    except errors.EphemeralError as exc:
        fields = {e["field"]: e["message"] for e in exc.errors or []}
        return again(exc.status if exc.status < 500 else 400, exc.detail, fields)
    response = RedirectResponse(f"/runs/{row.id}", status_code=303)
    if new_key:
        _set_key_cookie(response, request, new_key)
    return response
