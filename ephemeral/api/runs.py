"""``/v1``: the public API of DESIGN §3. Thin: parse, authorise, call the runtime, render."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from ephemeral import errors
from ephemeral.api import sse
from ephemeral.api.auth import get_runtime, principal
from ephemeral.api.schemas import (
    PROBLEM_CONTENT,
    EventObject,
    Health,
    ImageList,
    IsolationInfo,
    ModelList,
    RunObject,
    RunPage,
    problems,
)
from ephemeral.engine.runtime import Runtime
from ephemeral.events import Event
from ephemeral.lifecycle import TERMINAL_STATUSES, RunStatus
from ephemeral.models import default_model, usable_models
from ephemeral.policy import RunRequest
from ephemeral.runview import run_object
from ephemeral.store import Principal, RunRow

router = APIRouter()
v1 = APIRouter(prefix="/v1", tags=["runs"])

RUN_ID_PATTERN = r"^run_[0-9a-f]{32}$"
QUEUE_FULL = {
    "description": "Too many runs already wait for an execution slot on this host; nothing "
    "was reserved. Retry after `Retry-After` seconds (with the same Idempotency-Key).",
    "content": PROBLEM_CONTENT,
    "headers": {
        "Retry-After": {
            "description": "Seconds to wait before retrying",
            "schema": {"type": "integer", "minimum": 1},
        }
    },
}
IDEMPOTENCY_KEY_PATTERN = r"^[\x20-\x7E]{1,255}$"

Auth = Annotated[Principal, Depends(principal)]
Rt = Annotated[Runtime, Depends(get_runtime)]


def canonical_hash(data: Any) -> str:
    """sha256 of canonical JSON: key order and spacing do not matter."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def body_hash(request: RunRequest) -> str:
    """The Idempotency-Key fingerprint of a run request: its parsed body, canonical."""
    return canonical_hash(request.model_dump(mode="json"))


def created(obj: dict[str, Any], location: str, replayed: bool) -> JSONResponse:
    """201 with ``Location`` for a new resource; 200 + ``Idempotent-Replayed`` for a replay."""
    headers = {"Location": location}
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return JSONResponse(obj, status_code=200 if replayed else 201, headers=headers)


def base_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")


async def render_run(request: Request, runtime: Runtime, row: RunRow) -> dict[str, Any]:
    obj = run_object(row, base_url(request))
    if obj["output"] is None and row.status in TERMINAL_STATUSES and row.settled:
        # A zero-data-retention run's output is held in memory (or sealed in the store by the
        # worker that ran it) and handed out exactly once (to the first read of the settled
        # run: `runs.wait` returns that read).
        obj["output"] = await runtime.take_or_unseal_zdr_output(row)
    return obj


@router.get("/healthz", response_model=Health, tags=["meta"])
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@v1.post(
    "/runs",
    status_code=201,
    response_model=RunObject,
    responses={
        200: {
            "description": "Idempotent replay: the run this key created before "
            "(header `Idempotent-Replayed: true`)",
            "model": RunObject,
        },
        **problems(401, 402, 409, 413, 415, 422),
        429: QUEUE_FULL,
    },
    summary="Start a run",
)
async def create_run(
    body: RunRequest,
    request: Request,
    who: Auth,
    runtime: Rt,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            pattern=IDEMPOTENCY_KEY_PATTERN,
            description="1-255 printable ASCII characters; same key + same body → same run",
        ),
    ] = None,
) -> JSONResponse:
    row, replayed = await runtime.submit(
        who.org_id,
        body,
        idempotency_key=idempotency_key,
        body_hash=body_hash(body) if idempotency_key is not None else None,
    )
    return created(await render_run(request, runtime, row), f"/v1/runs/{row.id}", replayed)


@v1.get("/runs", response_model=RunPage, responses=problems(401, 422), summary="List runs")
async def list_runs(
    request: Request,
    who: Auth,
    runtime: Rt,
    status: RunStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> dict[str, Any]:
    rows, next_cursor = await runtime.store.runs.list(
        who.org_id, status=status, limit=limit, cursor=cursor or None
    )
    return {"runs": [run_object(r, base_url(request)) for r in rows], "next_cursor": next_cursor}


@v1.get("/runs/{run_id}", response_model=RunObject, responses=problems(401, 404, 422))
async def get_run(request: Request, who: Auth, runtime: Rt, run_id: str) -> dict[str, Any]:
    row = await runtime.store.runs.get(run_id, who.org_id)
    return await render_run(request, runtime, row)


@v1.get(
    "/runs/{run_id}/events",
    response_model=list[EventObject],
    responses={
        200: {
            "description": "The events as a JSON list, or with `Accept: text/event-stream` a live "
            "SSE stream (`id:` = seq; resumes after `Last-Event-ID`; ends after "
            "`run.settled`).",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        **problems(401, 404, 422),
    },
)
async def get_events(
    request: Request,
    who: Auth,
    runtime: Rt,
    run_id: str,
    after: sse.After = 0,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> Response:
    await runtime.store.runs.get(run_id, who.org_id)  # 404 for another org's run
    resume = sse.parse_last_event_id(last_event_id)
    start = max(after, resume or 0)
    if "text/event-stream" in request.headers.get("accept", ""):

        def render(ev: Event) -> str:
            return sse.frame(ev.model_dump(mode="json"), id=ev.seq, event=ev.type)

        return StreamingResponse(
            sse.stream(runtime.events(run_id, start, follow=True), render),
            media_type="text/event-stream",
            headers=sse.SSE_HEADERS,
        )
    events = [ev.model_dump(mode="json") async for ev in runtime.events(run_id, start)]
    return JSONResponse(events)


CANCEL_PENDING = {
    "description": "The run executes in another process, which has not confirmed the cancel "
    "within the wait: the run object as it is now. It settles `cancelled` shortly; follow its "
    "events or read it again.",
    "model": RunObject,
}


@v1.post(
    "/runs/{run_id}/cancel",
    response_model=RunObject,
    responses={202: CANCEL_PENDING, **problems(401, 404, 422)},
)
async def cancel_run(
    request: Request, response: Response, who: Auth, runtime: Rt, run_id: str
) -> dict[str, Any]:
    row = await runtime.cancel(run_id, who.org_id)
    # 200 means the run is ended; a caller must never read a `running` object as "cancelled".
    if row.status not in TERMINAL_STATUSES:
        response.status_code = 202
    return run_object(row, base_url(request))


@v1.delete(
    "/runs/{run_id}",
    response_model=RunObject,
    responses=problems(401, 404, 409, 422),
    summary="Erase a run's content (prompt, commands, outputs); billing stays",
)
async def delete_run(request: Request, who: Auth, runtime: Rt, run_id: str) -> dict[str, Any]:
    row = await runtime.store.runs.get(run_id, who.org_id)
    if row.status not in TERMINAL_STATUSES:
        await runtime.cancel(run_id, who.org_id)
        try:
            await runtime.wait(run_id, timeout=30)
        except TimeoutError as exc:
            raise errors.Conflict("the run is still stopping; retry the DELETE") from exc
    await runtime.store.retention.erase(run_id)
    await runtime.take_or_unseal_zdr_output(await runtime.store.runs.get(run_id))
    return run_object(await runtime.store.runs.get(run_id, who.org_id), base_url(request))


@v1.get("/costs", responses=problems(401, 422), tags=["costs"], summary="Spend of your org")
async def costs(
    who: Auth,
    runtime: Rt,
    by: Annotated[
        str, Query(description="model, recipe, day, org, status or kind (run or session)")
    ] = "model",
    since: Annotated[str, Query(max_length=16, description="window: 30d, 12h, 2w or all")] = "30d",
) -> dict[str, Any]:
    """Spend grouped by one dimension, over your org's recorded runs only (money in micros)."""
    from ephemeral.records import Records, parse_since

    window = parse_since(since)

    def read() -> tuple[list[str], list[tuple[Any, ...]]]:
        # One DuckDB connection per request: connections are not safe to share across threads.
        records = Records(runtime.settings.records_dir)
        try:
            return records.costs(by, window, org_id=who.org_id)
        finally:
            records.close()

    columns, rows = await asyncio.to_thread(read)
    return {
        "by": by,
        "since": since,
        "rows": [dict(zip(columns, row, strict=True)) for row in rows],
    }


@v1.get("/isolation", response_model=IsolationInfo, responses=problems(401), tags=["meta"])
async def isolation(request: Request, who: Auth, runtime: Rt) -> dict[str, Any]:
    cache = request.app.state.isolation_cache
    if cache.get("info") is None:
        cache["info"] = await runtime.isolation_info()
    info: dict[str, Any] = cache["info"]
    return info


@v1.get("/models", response_model=ModelList, responses=problems(401), tags=["meta"])
async def list_models(who: Auth, runtime: Rt) -> dict[str, Any]:
    """The models a run here can name, with their prices: a priced model whose provider has a
    key here (or a local base URL), and the replays of this server's cassettes."""
    settings = runtime.settings
    listed = await asyncio.to_thread(usable_models, settings, runtime.price_book)
    return {
        "models": listed,
        "default": default_model(settings),
        "price_book": runtime.price_book.version,
    }


@v1.get("/images", response_model=ImageList, responses=problems(401), tags=["meta"])
async def list_images(who: Auth, runtime: Rt) -> dict[str, Any]:
    """The images this server has built: what a run's ``image`` may name."""
    return {"images": await asyncio.to_thread(runtime.images), "default": runtime.settings.image}
