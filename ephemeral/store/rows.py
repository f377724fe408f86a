"""What several repositories of the store read or check inside their own unit of work: an org
or a run by id, the run fields a writer may set, and the size bound on the JSON they keep."""

from __future__ import annotations

import json
from collections.abc import Collection
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from ephemeral import errors
from ephemeral.lifecycle import RunStatus, TerminationReason
from ephemeral.store.models import Org, RunRow
from ephemeral.store.schema import orgs, runs

RUN_STATUSES: frozenset[str] = frozenset(RunStatus)
TERMINATION_REASONS: frozenset[str] = frozenset(TerminationReason)
_DATETIME_FIELDS = ("started_at", "ended_at", "lease_renewed_at", "lease_expires_at")
_TEXT_FIELDS = (
    "host",
    "isolation",
    "runtime",
    "sandbox_id",
    "image",
    "image_hash",
    "termination_detail",
    "output",
    "owner",
    "prompt",
)
_DICT_FIELDS = ("usage", "labels")
UPDATABLE_FIELDS = frozenset(
    {"status", "termination_reason", *_DATETIME_FIELDS, *_TEXT_FIELDS, *_DICT_FIELDS}
)


def json_size(field: str, value: Any, limit: int) -> int:
    try:
        size = len(json.dumps(value, separators=(",", ":")).encode())
    except (TypeError, ValueError) as exc:
        raise errors.InvalidRequest.field(field, f"is not JSON-serialisable: {exc}") from exc
    if size > limit:
        raise errors.InvalidRequest.field(field, f"is {size} bytes, over the {limit}-byte cap")
    return size


def zdr(policy: Any) -> bool:
    """Whether a run's stored policy asks for zero data retention."""
    return isinstance(policy, dict) and bool(policy.get("zero_data_retention"))


async def org(conn: AsyncConnection, name_or_id: str) -> Org:
    row = (
        await conn.execute(
            sa.select(orgs).where(sa.or_(orgs.c.id == name_or_id, orgs.c.name == name_or_id))
        )
    ).first()
    if row is None:
        raise errors.NotFound(f"org {name_or_id!r} not found")
    return Org.model_validate(row._mapping)


async def run(conn: AsyncConnection, run_id: str, org_id: str | None = None) -> RunRow:
    query = sa.select(runs).where(runs.c.id == run_id)
    if org_id is not None:
        query = query.where(runs.c.org_id == org_id)
    row = (await conn.execute(query)).first()
    if row is None:
        raise errors.NotFound(f"run {run_id} not found")
    return RunRow.model_validate(row._mapping)


async def ids_among(conn: AsyncConnection, run_ids: Collection[str], *where: Any) -> list[str]:
    """Which of ``run_ids`` match ``where``."""
    found = await conn.execute(sa.select(runs.c.id).where(runs.c.id.in_(sorted(run_ids)), *where))
    return [str(r[0]) for r in found]


async def runs_where(conn: AsyncConnection, *where: Any) -> list[RunRow]:
    rows = await conn.execute(sa.select(runs).where(*where).order_by(runs.c.created_at))
    return [RunRow.model_validate(r._mapping) for r in rows]


def run_values(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` checked as values of a run's row (names, types, sizes, known statuses)."""
    unknown = sorted(set(fields) - UPDATABLE_FIELDS)
    if unknown:
        raise errors.InvalidRequest.field(
            unknown[0], f"is not an updatable run field ({', '.join(sorted(UPDATABLE_FIELDS))})"
        )
    status = fields.get("status")
    if status is not None and status not in RUN_STATUSES:
        raise errors.InvalidRequest.field("status", f"unknown run status {status!r}")
    reason = fields.get("termination_reason")
    if reason is not None and reason not in TERMINATION_REASONS:
        raise errors.InvalidRequest.field("termination_reason", f"unknown reason {reason!r}")
    for name in _DATETIME_FIELDS:
        value = fields.get(name)
        if value is not None and (not isinstance(value, datetime) or value.tzinfo is None):
            raise errors.InvalidRequest.field(name, "must be an aware datetime")
    for name in _TEXT_FIELDS:
        if fields.get(name) is not None and not isinstance(fields[name], str):
            raise errors.InvalidRequest.field(name, "must be a string")
    for name in _DICT_FIELDS:
        if name in fields:
            if not isinstance(fields[name], dict):
                raise errors.InvalidRequest.field(name, "must be an object")
            json_size(name, fields[name], 1 << 20)
    return dict(fields)
