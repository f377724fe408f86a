"""A charge that carries an event (compute + ``sandbox.destroyed``) written by several settlers
of one run at once (the lease sweeps of several processes, issue 22): one charge, one event."""

from __future__ import annotations

import asyncio

from ephemeral.ids import new_run_id
from ephemeral.store import Org, Store
from tests.store.storehelp import policy


async def test_concurrent_settlers_write_the_charge_and_its_event_once(
    db_url: str, org: Org, store: Store
) -> None:
    run, _ = await store.runs.admit(
        org_id=org.id, run_id=new_run_id(), model="replay/x", prompt="p", policy=policy(10_000)
    )
    others = [await Store.open(db_url) for _ in range(4)]  # one engine per "process"
    try:
        totals = await asyncio.gather(
            *(
                s.money.charge(
                    run.id,
                    "compute",
                    700,
                    key=f"{run.id}:compute",
                    event=("sandbox.destroyed", {"lifetime_ms": 1000}),
                )
                for s in others
                for _ in range(3)
            )
        )
    finally:
        for s in others:
            await s.close()
    assert set(totals) == {700}
    types = [e.type for e in await store.events.list(run.id)]
    assert types.count("sandbox.destroyed") == 1, types
    assert (await store.money.charged(run.id)).get("compute_micros") == 700
