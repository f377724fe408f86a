"""Helpers shared by the store tests."""

from __future__ import annotations

import sqlalchemy as sa

from ephemeral.store import Store
from ephemeral.store.schema import runs


def policy(max_cost_micros: int = 40_000, **extra: object) -> dict[str, object]:
    return {
        "web": False,
        "shell": True,
        "files": [],
        "connections": [],
        "zero_data_retention": False,
        "timeout_seconds": 120,
        "max_cost_micros": max_cost_micros,
        "isolation": "auto",
        **extra,
    }


async def force_status(store: Store, run_id: str, status: str, reason: str | None = None) -> None:
    """Write a status with no events and no settlement: a state only a crash of an older
    version (which ended a run in several transactions) could leave behind."""
    async with store.engine.begin() as conn:
        await conn.execute(
            sa.update(runs)
            .where(runs.c.id == run_id)
            .values(status=status, termination_reason=reason)
        )
