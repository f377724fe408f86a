"""An older database is brought up to the current schema when the store opens (additive only)."""

from __future__ import annotations

import sqlalchemy as sa

from ephemeral.store import Store
from ephemeral.store.backends import create_engine


async def _columns(url: str) -> dict[str, object]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            cols = await conn.run_sync(lambda c: sa.inspect(c).get_columns("runs"))
    finally:
        await engine.dispose()
    return {c["name"]: c["type"] for c in cols}


async def test_open_adds_missing_columns_and_widens_strings(db_url: str) -> None:
    await (await Store.open(db_url)).close()
    engine = create_engine(db_url)
    async with engine.begin() as conn:  # the runs table as the previous release made it
        await conn.execute(sa.text("ALTER TABLE runs DROP COLUMN runtime"))
        if conn.dialect.name == "postgresql":
            await conn.execute(sa.text("ALTER TABLE runs ALTER COLUMN isolation TYPE VARCHAR(20)"))
    await engine.dispose()
    assert "runtime" not in await _columns(db_url)

    store = await Store.open(db_url)
    try:
        org = await store.orgs.ensure("old", initial_credit_micros=1_000_000)
        row, _ = await store.runs.admit(
            org_id=org.id,
            run_id="run_" + "a" * 32,
            model="replay/sandbox-proof",
            prompt="p",
            policy={"max_cost_micros": 1000},
        )
        row = await store.runs.update(
            row.id, isolation="namespaces-privileged", runtime="bubblewrap 0.8.0"
        )
        assert (row.isolation, row.runtime) == ("namespaces-privileged", "bubblewrap 0.8.0")
    finally:
        await store.close()
    cols = await _columns(db_url)
    assert getattr(cols["isolation"], "length", 40) >= 40
    await (await Store.open(db_url)).close()  # idempotent
