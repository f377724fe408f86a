"""``/v1/sandboxes``: sandbox sessions over HTTP (docs/integrations.md). Thin: parse,
authorise, call ``runtime.sessions``, render. Auth, idempotency, 402 and problems as for runs."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from ephemeral.api.runs import IDEMPOTENCY_KEY_PATTERN, Auth, Rt, base_url, canonical_hash, created
from ephemeral.api.schemas import Breakdown, Termination, problems
from ephemeral.ids import rfc3339
from ephemeral.labels import string_labels
from ephemeral.lifecycle import RunKind
from ephemeral.policy import Policy
from ephemeral.runview import cost_view, termination_view, timestamp
from ephemeral.sessions.requests import MAX_FILE_BYTES, ExecRequest, SessionRequest
from ephemeral.store import RunRow

sandboxes = APIRouter(prefix="/v1", tags=["sandboxes"])

PathQuery = Annotated[
    str,
    Query(
        min_length=1,
        max_length=4096,
        description="a path in the sandbox; relative paths are under its scratch directory",
    ),
]


class SessionCost(BaseModel):
    reserved_micros: int
    charged_micros: int | None
    refunded_micros: int | None
    breakdown: Breakdown


class SessionUsage(BaseModel):
    execs: int


class SessionLinks(BaseModel):
    self: str
    events: str
    page: str


class SessionObject(BaseModel):
    id: str = Field(pattern=r"^run_[0-9a-f]{32}$")
    kind: str
    status: str
    created_at: str
    started_at: str | None
    ended_at: str | None
    expires_at: str | None
    policy: dict[str, Any]
    isolation: str | None
    runtime: str | None
    termination: Termination | None
    usage: SessionUsage
    cost: SessionCost
    labels: dict[str, str] = Field(default_factory=dict)
    links: SessionLinks


class ExecOutput(BaseModel):
    exit_code: int
    stdout: str = Field(description="UTF-8 (invalid bytes replaced), at most max_output_bytes")
    stderr: str
    duration_ms: int
    truncated: bool
    timed_out: bool = Field(description="killed at its timeout (with everything it started)")


def session_hash(body: SessionRequest) -> str:
    """sha256 of the canonical JSON, marked as a sandbox: a run's key never replays a session."""
    return canonical_hash({"sandbox": body.model_dump(mode="json")})


# The URL names a sandbox session by its id (a run id); the path parameter keeps its published
# name, ``sandbox_id``, for clients (the OpenAPI document and its operation ids). Inside it is
# a session id: a sandbox id is the driver's own (docs/architecture.md, "Words").
SessionId = Annotated[str, Path(alias="sandbox_id")]


@sandboxes.post(
    "/sandboxes",
    status_code=201,
    response_model=SessionObject,
    responses={
        200: {
            "description": "Idempotent replay: the session this key created before "
            "(header `Idempotent-Replayed: true`)",
            "model": SessionObject,
        },
        **problems(401, 402, 409, 413, 415, 422),
    },
    summary="Start a sandbox session",
)
async def create_sandbox(
    body: SessionRequest,
    request: Request,
    who: Auth,
    runtime: Rt,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            pattern=IDEMPOTENCY_KEY_PATTERN,
            description="1-255 printable ASCII characters; same key + same body → same session",
        ),
    ] = None,
) -> JSONResponse:
    """Reserve ``max_cost_micros``, start a sandbox (warm when one is ready) and answer with
    the session ``running`` (or settled ``failed`` when its sandbox could not start)."""
    row, replayed = await runtime.sessions.create(
        who.org_id,
        body,
        idempotency_key=idempotency_key,
        body_hash=session_hash(body) if idempotency_key is not None else None,
    )
    return created(session_object(row, base_url(request)), f"/v1/sandboxes/{row.id}", replayed)


@sandboxes.get(
    "/sandboxes/{sandbox_id}", response_model=SessionObject, responses=problems(401, 404, 422)
)
async def get_sandbox(
    request: Request, who: Auth, runtime: Rt, session_id: SessionId
) -> dict[str, Any]:
    return session_object(await runtime.sessions.get(session_id, who.org_id), base_url(request))


@sandboxes.post(
    "/sandboxes/{sandbox_id}/exec",
    response_model=ExecOutput,
    responses=problems(401, 404, 409, 413, 415, 422, 502),
    summary="Run a command in the sandbox",
)
async def exec_in_sandbox(
    body: ExecRequest, who: Auth, runtime: Rt, session_id: SessionId
) -> dict[str, Any]:
    """An argv or a shell string; a command past its timeout comes back ``timed_out``. 409 once
    the session has ended."""
    res = await runtime.sessions.exec(session_id, who.org_id, body)
    return res.model_dump()


@sandboxes.put(
    "/sandboxes/{sandbox_id}/files",
    status_code=204,
    responses={
        **problems(401, 403, 404, 409, 413, 422, 502),
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string"}}},
        }
    },
    summary="Write a file (the raw body) as the sandbox's worker",
)
async def put_file(
    request: Request, who: Auth, runtime: Rt, session_id: SessionId, path: PathQuery
) -> Response:
    data = await request.body()
    await runtime.sessions.write_file(session_id, who.org_id, path, data)
    return Response(status_code=204)


@sandboxes.get(
    "/sandboxes/{sandbox_id}/files",
    responses={
        200: {
            "description": "The file's bytes",
            "content": {"application/octet-stream": {"schema": {"type": "string"}}},
        },
        **problems(401, 403, 404, 409, 413, 422, 502),
    },
    response_class=Response,
    summary="Read a file as the sandbox's worker",
)
async def get_file(
    who: Auth,
    runtime: Rt,
    session_id: SessionId,
    path: PathQuery,
    max_bytes: Annotated[int, Query(ge=0, le=MAX_FILE_BYTES)] = MAX_FILE_BYTES,
) -> Response:
    """403 when the worker may not read it, 404 when it does not exist (or the session is not
    yours), 409 for a directory, 413 past ``max_bytes``."""
    data = await runtime.sessions.read_file(session_id, who.org_id, path, max_bytes)
    return Response(content=data, media_type="application/octet-stream")


@sandboxes.delete(
    "/sandboxes/{sandbox_id}",
    response_model=SessionObject,
    responses=problems(401, 404, 409, 422),
    summary="End the session: destroy the sandbox, settle",
)
async def delete_sandbox(
    request: Request, who: Auth, runtime: Rt, session_id: SessionId
) -> dict[str, Any]:
    """Idempotent: an ended session is returned as it is."""
    row = await runtime.sessions.end(session_id, who.org_id)
    return session_object(row, base_url(request))


def session_object(row: RunRow, base_url: str | None = None) -> dict[str, Any]:
    """The public sandbox session object (``GET /v1/sandboxes/{id}``)."""
    policy = Policy.model_validate(row.policy)
    prefix = (base_url or "").rstrip("/")
    expires_at = None
    if row.started_at is not None:
        started = row.started_at.timestamp()
        expires_at = rfc3339(_from_ts(started + policy.timeout_seconds))
    return {
        "id": row.id,
        "kind": RunKind.SESSION,
        "status": row.status,
        "created_at": timestamp(row.created_at),
        "started_at": timestamp(row.started_at),
        "ended_at": timestamp(row.ended_at),
        "expires_at": expires_at,
        "policy": row.policy,
        "isolation": row.isolation,
        "runtime": row.runtime,
        "termination": termination_view(row),
        "usage": {"execs": int((row.usage or {}).get("execs", 0))},
        "cost": cost_view(row),
        "labels": string_labels(row.labels),
        "links": {
            "self": f"{prefix}/v1/sandboxes/{row.id}",
            "events": f"{prefix}/v1/runs/{row.id}/events",
            "page": f"{prefix}/runs/{row.id}",
        },
    }


def _from_ts(seconds: float) -> datetime:
    return datetime.fromtimestamp(math.floor(seconds * 1000) / 1000, UTC)
