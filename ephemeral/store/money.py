"""Money on a run (``store.money``): charges inside its reservation, and its settlement.

The statements are :mod:`ephemeral.store.ledger`'s; each method here is one unit of work over
them. :func:`charge` takes an open connection, so that a close charges compute in its own
transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from ephemeral.store import events as events_
from ephemeral.store import ledger, rows
from ephemeral.store.db import Repository
from ephemeral.store.models import Settlement
from ephemeral.store.schema import runs


async def charge(
    conn: AsyncConnection,
    run_id: str,
    kind: str,
    micros: int,
    key: str,
    event: tuple[str, dict[str, Any]] | None,
) -> int:
    if event is not None:
        # Lock the run's row first: two settlers of one run (the lease sweeps of several
        # processes) must not both see "not charged yet" and both write the event. (The
        # close's own compare-and-set took this lock already; again is harmless.)
        await conn.execute(
            sa.update(runs).where(runs.c.id == run_id).values(last_seq=runs.c.last_seq)
        )
    total, fresh = await ledger.charge_many(conn, run_id=run_id, kind=kind, charges=[(key, micros)])
    if event is not None and key in fresh:  # a replayed charge wrote its event already
        await events_.append(conn, run_id, *event)
    return total


class Money(Repository):
    async def charge(
        self,
        run_id: str,
        kind: str,
        micros: int,
        key: str,
        *,
        event: tuple[str, dict[str, Any]] | None = None,
    ) -> int:
        """Charge inside the run's reservation; idempotent on ``key``; returns the run's total.

        Raises BudgetExhausted if the total would pass the reservation (nothing is charged).
        ``event`` is appended in the same transaction (a compute charge and
        ``sandbox.destroyed`` are one fact: recovery must never see one without the other).
        """
        if event is not None:
            events_.check([event])
        async with self._db.write() as conn:
            return await charge(conn, run_id, kind, micros, key, event)

    async def charge_batch(
        self,
        run_id: str,
        kind: str,
        charges: list[tuple[str, int]],
        events: Sequence[tuple[str, dict[str, Any]]] = (),
    ) -> int:
        """Several charges ``(key, micros)`` in one transaction (one commit), each as
        :meth:`charge`: idempotent on its key, inside the reservation; ``events`` are appended
        in the same transaction. All or none: raises BudgetExhausted or Conflict (settled) and
        charges nothing. Returns the run's total."""
        events_.check(events)
        async with self._db.write() as conn:
            total = 0
            if charges:
                total, _ = await ledger.charge_many(conn, run_id=run_id, kind=kind, charges=charges)
            if events:
                await events_.append_many(conn, run_id, events)
            return total

    async def charged(self, run_id: str) -> dict[str, int]:
        async with self._db.read() as conn:
            await rows.run(conn, run_id)
            return await ledger.breakdown(conn, run_id)

    async def settle(self, run_id: str) -> Settlement:
        """Release the reservation and debit the org by what was charged. Idempotent."""
        async with self._db.write() as conn:
            return await ledger.settle(conn, run_id)
