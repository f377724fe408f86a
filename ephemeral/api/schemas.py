"""Response models: they document the wire format in the OpenAPI spec (DESIGN §3, §4).

The request body is :class:`ephemeral.policy.RunRequest` itself, so the API, the CLI and the
recipes validate a run request with one model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from ephemeral.lifecycle import RunStatus, TerminationReason


class ProblemItem(BaseModel):
    field: str
    message: str


class Problem(BaseModel):
    type: str
    title: str
    status: int
    detail: str
    errors: list[ProblemItem] | None = None


class Termination(BaseModel):
    reason: TerminationReason
    detail: str | None = None


class Usage(BaseModel):
    model_calls: int
    input_tokens: int
    output_tokens: int


class Breakdown(BaseModel):
    model_micros: int
    web_micros: int
    compute_micros: int


class Cost(BaseModel):
    reserved_micros: int
    charged_micros: int | None
    refunded_micros: int | None
    breakdown: Breakdown


class Links(BaseModel):
    self: str
    events: str
    page: str


class RunObject(BaseModel):
    id: str = Field(pattern=r"^run_[0-9a-f]{32}$")
    status: RunStatus
    created_at: str | None
    started_at: str | None
    ended_at: str | None
    model: str
    policy: dict[str, Any]
    isolation: str | None
    image: str | None = None
    image_hash: str | None = None
    # the sandbox runtime's version line, measured by the host ("runsc version 0.0~20221219.0")
    runtime: str | None = None
    # the EPHEMERAL_HOST_ID of the host that executed (or is executing) the run
    host: str | None = None
    termination: Termination | None
    usage: Usage
    cost: Cost
    output: str | None
    labels: dict[str, Any] = Field(default_factory=dict)
    links: Links


class RunPage(BaseModel):
    runs: list[RunObject]
    next_cursor: str | None = Field(
        description="Pass as `cursor` for the next page; null on the last page."
    )


class EventObject(BaseModel):
    seq: int = Field(ge=1)
    run_id: str
    type: str
    at: str
    data: dict[str, Any]


class IsolationLevel(BaseModel):
    available: bool
    reason: str | None
    # the runtime binary's version line ("runsc version 0.0~20221219.0"), "missing" if absent
    runtime: str | None = None
    # namespaces only: EPHEMERAL_NAMESPACES_PRIVILEGED is on (agent is host root; runs say
    # `namespaces-privileged`)
    privileged: bool = False


class IsolationInfo(BaseModel):
    available: list[str]
    auto: str | None
    levels: dict[str, IsolationLevel]


class ImageObject(BaseModel):
    name: str
    hash: str  # sha256 of the definition (and its base's hash)
    size_bytes: int
    built_at: str  # RFC 3339
    base: str | None = None


class ImageList(BaseModel):
    images: list[ImageObject]
    default: str  # what a run that names no image gets


class ModelPriceObject(BaseModel):
    input_per_mtok: int  # micros per million tokens
    output_per_mtok: int
    cached_input_per_mtok: int


class ModelObject(BaseModel):
    id: str  # what a run's `model` names: provider/name
    provider: str
    default: bool  # what a run naming no model gets
    price: ModelPriceObject
    replays: str | None = None  # a replay: the model its cassette recorded
    description: str | None = None
    prompt: str | None = None  # a replay: the (first) prompt it answers, and the only ones


class ModelList(BaseModel):
    models: list[ModelObject]
    default: str | None  # None: a run must name its model (422 naming `model` otherwise)
    price_book: str  # the price book's version


class Health(BaseModel):
    status: Literal["ok"]


PROBLEM_CONTENT = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}


def problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries documenting each error status with the problem schema."""
    text = {
        401: "Missing, malformed, unknown or revoked API key",
        402: "The org balance cannot cover max_cost_micros",
        404: "No such run in your organisation",
        409: "Conflict (e.g. the same Idempotency-Key is still being admitted)",
        413: "Body too large",
        415: "Body is not JSON",
        422: "Invalid request; `errors` names each field",
    }
    return {s: {"description": text.get(s, "Error"), "content": PROBLEM_CONTENT} for s in statuses}
