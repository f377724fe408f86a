"""What the store hands out: plain pydantic rows, never SQLAlchemy objects."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Row(BaseModel):
    model_config = ConfigDict(frozen=True)


class Org(_Row):
    id: str
    name: str
    balance_micros: int
    reserved_micros: int

    @property
    def available_micros(self) -> int:
        """Money that new reservations may still take."""
        return self.balance_micros - self.reserved_micros


class ApiKey(_Row):
    id: str
    org_id: str
    member: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None = None


class Principal(_Row):
    org_id: str
    member: str
    key_id: str


class Settlement(_Row):
    reserved_micros: int
    charged_micros: int
    refunded_micros: int
    breakdown: dict[str, int]


class RunRow(_Row):
    id: str
    org_id: str
    status: str
    model: str
    prompt: str | None
    policy: dict[str, Any]
    labels: dict[str, Any] = Field(default_factory=dict)
    isolation: str | None = None
    runtime: str | None = None
    sandbox_id: str | None = None
    image: str | None = None
    image_hash: str | None = None
    created_at: datetime
    started_at: datetime | None = None
    ended_at: datetime | None = None
    termination_reason: str | None = None
    termination_detail: str | None = None
    usage: dict[str, Any] = Field(default_factory=dict)
    reserved_micros: int
    charged_micros: int = 0
    refunded_micros: int = 0
    breakdown: dict[str, int] = Field(default_factory=dict)
    output: str | None = None
    owner: str | None = None
    idempotency_key: str | None = None
    settled_at: datetime | None = None
    erased_at: datetime | None = None
    kind: str | None = None  # "session" for a sandbox session; None is a run

    host: str | None = None
    lease_renewed_at: datetime | None = None
    lease_expires_at: datetime | None = None
    cancel_requested_at: datetime | None = None
    recorded_at: datetime | None = None  # its analysis records are written (engine.record)
    dispatched_at: datetime | None = None  # its Prefect task run exists (ephemeral.cluster.outbox)
    dispatches: int | None = None  # its hand-over number; a drain's hand-back raises it

    @property
    def settled(self) -> bool:
        return self.settled_at is not None
