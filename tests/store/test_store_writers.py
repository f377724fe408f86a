"""SQLite: one writing connection per engine, so writers take turns in order, and reads run
beside a write transaction instead of waiting for it."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa

from ephemeral.ids import new_run_id
from ephemeral.store import Store
from ephemeral.store.schema import orgs
from tests.store.storehelp import policy


async def test_writers_take_turns_in_the_order_they_asked(sqlite_store: Store) -> None:
    org = await sqlite_store.orgs.ensure("turns", initial_credit_micros=100_000)
    run, _ = await sqlite_store.runs.admit(
        org_id=org.id, run_id=new_run_id(), model="replay/x", prompt="p", policy=policy(1_000)
    )
    async with sqlite_store.engine.begin() as conn:  # the write lock, held
        await conn.execute(sa.update(orgs).where(orgs.c.id == org.id).values(name="turns"))
        appends = []
        for i in range(20):
            appends.append(asyncio.create_task(sqlite_store.events.append(run.id, "x.n", {"i": i})))
            await asyncio.sleep(0)  # each asks before the next
        # A read neither waits for the held transaction nor sees it uncommitted.
        seen = await asyncio.wait_for(sqlite_store.events.list(run.id), 10)
        assert [e.type for e in seen] == ["run.queued"]
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in appends)  # queued behind the open transaction
    events = await asyncio.gather(*appends)
    # Numbered in the order asked: they waited in one queue, not in SQLite's busy handler,
    # whose sleeping retries let any of them in first.
    assert [e.data["i"] for e in events] == list(range(20))
    assert [e.seq for e in events] == list(range(2, 22))
