"""What several repositories of the store read or check inside their own unit of work: an org
or a run by id, and the size bound on the JSON they keep."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from ephemeral import errors
from ephemeral.store.models import Org, RunRow
from ephemeral.store.schema import orgs, runs


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


async def runs_where(conn: AsyncConnection, *where: Any) -> list[RunRow]:
    rows = await conn.execute(sa.select(runs).where(*where).order_by(runs.c.created_at))
    return [RunRow.model_validate(r._mapping) for r in rows]
