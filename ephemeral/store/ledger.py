"""Money: admission (reserve), itemised charges inside a reservation, settlement, org credits.

Every money move is one conditional ``UPDATE … RETURNING`` whose WHERE clause states the
invariant it must keep, plus a ledger row with a unique idempotency key. No row back means the
move did not fit; nothing is read first and decided later, so concurrent writers cannot
overdraw (PostgreSQL re-checks the WHERE clause after waiting for a row lock; SQLite runs one
writer at a time under ``BEGIN IMMEDIATE``).

Balance semantics: ``orgs.balance_micros`` is money the org owns, ``orgs.reserved_micros`` the
part reserved for unsettled runs. Admission raises ``reserved``; settlement lowers ``reserved`` by
the run's reservation and ``balance`` by what the run was charged.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from ephemeral import errors
from ephemeral.ids import new_id, rfc3339, utcnow
from ephemeral.lifecycle import RunStatus
from ephemeral.money.amounts import usd
from ephemeral.store.models import Settlement
from ephemeral.store.schema import CHARGE_KINDS, idempotency, ledger, orgs, run_events, runs

MAX_IDEMPOTENCY_KEY = 255
MAX_LEDGER_KEY = 300
# Far below BIGINT's 9.2e18 so that sums of many amounts cannot overflow either.
MAX_MICROS = 10**15  # $1,000,000,000


def insert(conn: AsyncConnection, table: sa.Table) -> Any:
    """A dialect ``INSERT`` that supports ``ON CONFLICT`` (both backends spell it the same)."""
    if conn.dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def check_micros(field: str, value: object, *, allow_zero: bool = True) -> int:
    # bool is an int in Python; a JSON `true` must not become one micro-dollar.
    if not isinstance(value, int) or isinstance(value, bool):
        raise errors.InvalidRequest.field(field, "must be an integer number of micro-dollars")
    if value < 0 or (value == 0 and not allow_zero):
        raise errors.InvalidRequest.field(field, "must be positive" if not allow_zero else ">= 0")
    if value > MAX_MICROS:
        raise errors.InvalidRequest.field(field, f"must be at most {MAX_MICROS}")
    return value


async def bind_idempotency_key(
    conn: AsyncConnection,
    *,
    org_id: str,
    key: str,
    body_hash: str | None,
    run_id: str,
    now: datetime,
) -> sa.Row[Any] | None:
    """Bind ``key`` to ``run_id``; return the earlier binding instead if there is one.

    The binding is written ``done``: it commits with the admission or not at all (a concurrent
    binding of the same key waits for that commit, then finds it). The schema also allows
    ``admitting``, a binding left open across transactions; a request that meets one gets 409.
    """
    if not key or len(key) > MAX_IDEMPOTENCY_KEY or not key.isascii() or not key.isprintable():
        raise errors.InvalidRequest.field(
            "Idempotency-Key", f"must be 1-{MAX_IDEMPOTENCY_KEY} printable ASCII characters"
        )
    bound = await conn.execute(
        insert(conn, idempotency)
        .values(
            org_id=org_id,
            key=key,
            body_hash=body_hash,
            run_id=run_id,
            state="done",
            created_at=now,
        )
        .on_conflict_do_nothing()
        .returning(idempotency.c.run_id)
    )
    if bound.first() is not None:
        return None
    earlier = (
        await conn.execute(
            sa.select(idempotency).where(idempotency.c.org_id == org_id, idempotency.c.key == key)
        )
    ).one()
    if earlier.body_hash != body_hash:
        raise errors.InvalidRequest.field(
            "Idempotency-Key", "was already used with a different request body"
        )
    if earlier.state != "done":
        raise errors.Conflict("a request with this Idempotency-Key is still being admitted")
    return earlier


async def reserve(conn: AsyncConnection, *, org_id: str, amount: int) -> None:
    """Raise the org's reservation by ``amount`` if its available balance covers it."""
    reserved = await conn.execute(
        sa.update(orgs)
        .where(orgs.c.id == org_id, orgs.c.balance_micros - orgs.c.reserved_micros >= amount)
        .values(reserved_micros=orgs.c.reserved_micros + amount)
        .returning(orgs.c.reserved_micros)
    )
    if reserved.first() is None:
        org = (await conn.execute(sa.select(orgs).where(orgs.c.id == org_id))).first()
        if org is None:
            raise errors.NotFound(f"org {org_id} not found")
        available = org.balance_micros - org.reserved_micros
        raise errors.PaymentRequired(
            f"max_cost_micros {amount} ({usd(amount)}) does not fit: the org's available balance "
            f"is {available} micros ({usd(available)}; balance {org.balance_micros}, "
            f"held by running runs {org.reserved_micros})"
        )


async def admit(
    conn: AsyncConnection,
    *,
    org_id: str,
    run_id: str,
    model: str,
    prompt: str | None,
    policy: dict[str, Any],
    labels: dict[str, Any],
    idempotency_key: str | None,
    body_hash: str | None,
    owner: str | None = None,
    kind: str | None = None,
    image_hash: str | None = None,
) -> str | sa.Row[Any]:
    """Admit a run in the caller's transaction. Returns the replayed run's id, or the new
    run's row."""
    amount = check_micros("max_cost_micros", policy.get("max_cost_micros"), allow_zero=False)
    now = utcnow()
    if idempotency_key is not None:
        earlier = await bind_idempotency_key(
            conn, org_id=org_id, key=idempotency_key, body_hash=body_hash, run_id=run_id, now=now
        )
        if earlier is not None:
            return str(earlier.run_id)
    await reserve(conn, org_id=org_id, amount=amount)
    inserted = await conn.execute(
        sa.insert(runs)
        .values(
            id=run_id,
            org_id=org_id,
            status=RunStatus.QUEUED,
            model=model,
            prompt=prompt,
            policy=policy,
            labels=labels,
            created_at=now,
            usage={},
            reserved_micros=amount,
            charged_micros=0,
            refunded_micros=0,
            breakdown={},
            idempotency_key=idempotency_key,
            owner=owner,
            last_seq=1,
            kind=kind,
            image_hash=image_hash,
        )
        .returning(*runs.c)
    )
    row = inserted.one()
    await conn.execute(
        sa.insert(ledger).values(
            org_id=org_id,
            run_id=run_id,
            kind="reserve",
            amount_micros=amount,
            idempotency_key=f"{run_id}:reserve",
            at=now,
        )
    )
    await conn.execute(
        sa.insert(run_events).values(
            run_id=run_id,
            seq=1,
            type="run.queued",
            at=rfc3339(now),
            data={"reserved_micros": amount},
        )
    )
    return row


# A charge's statements, built once: on SQLite, building them cost more CPU than running them
# (profiled: ~58 % of a web request's charge). The ``b_`` names keep the bind parameters apart
# from the columns an UPDATE or INSERT would take them for.
_ORG_OF_RUN = sa.select(runs.c.org_id).where(runs.c.id == sa.bindparam("b_run_id"))
_ADD_CHARGE = (
    sa.update(runs)
    .where(
        runs.c.id == sa.bindparam("b_run_id"),
        runs.c.settled_at.is_(None),
        runs.c.charged_micros + sa.bindparam("b_micros", type_=sa.BigInteger)
        <= runs.c.reserved_micros,
    )
    .values(charged_micros=runs.c.charged_micros + sa.bindparam("b_micros", type_=sa.BigInteger))
    .returning(runs.c.charged_micros)
)
# One INSERT for every charge of a batch (executemany, sent as multi-row VALUES): the keys it
# returns are the fresh charges; a key it does not return was already in the ledger.
_NEW_CHARGES = {
    dialect: ins(ledger).on_conflict_do_nothing().returning(ledger.c.idempotency_key)
    for dialect, ins in (("postgresql", postgresql.insert), ("sqlite", sqlite.insert))
}


async def charge_many(
    conn: AsyncConnection, *, run_id: str, kind: str, charges: Sequence[tuple[str, int]]
) -> tuple[int, set[str]]:
    """Charges ``(key, micros)`` of one run and kind, each idempotent on its key, added to the
    run's total in one update: all fit the reservation or none is made (the caller's
    transaction rolls back). Returns the run's total and the keys charged now (a key not
    among them was in the ledger already)."""
    if kind not in CHARGE_KINDS:
        raise errors.InvalidRequest.field("kind", f"must be one of {', '.join(CHARGE_KINDS)}")
    if not charges:
        raise errors.InvalidRequest.field("charges", "must not be empty")
    wanted: dict[str, int] = {}
    for key, micros in charges:
        check_micros("micros", micros)
        if not key or len(key) > MAX_LEDGER_KEY:
            raise errors.InvalidRequest.field("key", f"must be 1-{MAX_LEDGER_KEY} characters")
        if wanted.setdefault(key, micros) != micros:
            raise errors.Conflict(f"charge key {key!r} is in the batch twice, for two amounts")
    run = (await conn.execute(_ORG_OF_RUN, {"b_run_id": run_id})).first()
    if run is None:
        raise errors.NotFound(f"run {run_id} not found")
    now = utcnow()
    # The ledger rows go first: a concurrent duplicate waits on the unique key and then does
    # nothing, so a retried charge can never be counted twice.
    rows = [
        {
            "org_id": run.org_id,
            "run_id": run_id,
            "kind": kind,
            "amount_micros": micros,
            "idempotency_key": key,
            "at": now,
        }
        for key, micros in wanted.items()
    ]
    result = await conn.execute(
        _NEW_CHARGES["postgresql" if conn.dialect.name == "postgresql" else "sqlite"],
        rows if len(rows) > 1 else rows[0],  # one row: a plain execute, no executemany
    )
    fresh = {r.idempotency_key for r in result}
    earlier_keys = [key for key in wanted if key not in fresh]
    if earlier_keys:
        earlier = await conn.execute(
            sa.select(
                ledger.c.idempotency_key, ledger.c.run_id, ledger.c.kind, ledger.c.amount_micros
            ).where(ledger.c.idempotency_key.in_(earlier_keys))
        )
        for row in earlier:
            if (row.run_id, row.kind, row.amount_micros) != (
                run_id,
                kind,
                wanted[row.idempotency_key],
            ):
                raise errors.Conflict(
                    f"charge key {row.idempotency_key!r} was already used for {row.kind} "
                    f"{row.amount_micros} micros on run {row.run_id}"
                )
    added_micros = sum(wanted[key] for key in fresh)
    if not added_micros:
        total = await conn.scalar(sa.select(runs.c.charged_micros).where(runs.c.id == run_id))
        return int(total or 0), fresh
    added = await conn.execute(_ADD_CHARGE, {"b_run_id": run_id, "b_micros": added_micros})
    row = added.first()
    if row is not None:
        return int(row.charged_micros), fresh
    now_run = (await conn.execute(sa.select(runs).where(runs.c.id == run_id))).one()
    if now_run.settled_at is not None:
        raise errors.Conflict(f"run {run_id} is already settled; no further charges")
    raise errors.BudgetExhausted(
        f"a {kind} charge of {added_micros} micros would bring run {run_id} to "
        f"{now_run.charged_micros + added_micros} micros, over its {now_run.reserved_micros} "
        "reserved"
    )


async def breakdown(conn: AsyncConnection, run_id: str) -> dict[str, int]:
    rows = await conn.execute(
        sa.select(ledger.c.kind, sa.func.sum(ledger.c.amount_micros))
        .where(ledger.c.run_id == run_id, ledger.c.kind.in_(CHARGE_KINDS))
        .group_by(ledger.c.kind)
    )
    sums = {kind: int(total) for kind, total in rows}
    return {f"{kind}_micros": sums.get(kind, 0) for kind in CHARGE_KINDS}


async def settle(conn: AsyncConnection, run_id: str) -> Settlement:
    now = utcnow()
    # Marking the run settled first row-locks it: a charge racing with us either committed
    # before (and is counted below) or re-checks `settled_at IS NULL` after us and fails.
    marked = (
        await conn.execute(
            sa.update(runs)
            .where(runs.c.id == run_id, runs.c.settled_at.is_(None))
            .values(settled_at=now, refunded_micros=runs.c.reserved_micros - runs.c.charged_micros)
            .returning(runs.c.org_id, runs.c.reserved_micros, runs.c.charged_micros)
        )
    ).first()
    if marked is None:
        done = (await conn.execute(sa.select(runs).where(runs.c.id == run_id))).first()
        if done is None:
            raise errors.NotFound(f"run {run_id} not found")
        return Settlement(
            reserved_micros=done.reserved_micros,
            charged_micros=done.charged_micros,
            refunded_micros=done.refunded_micros,
            breakdown=dict(done.breakdown),
        )
    reserved, charged = int(marked.reserved_micros), int(marked.charged_micros)
    items = await breakdown(conn, run_id)
    if sum(items.values()) != charged:
        raise errors.EphemeralError(
            f"ledger of run {run_id} sums to {sum(items.values())} but the run says {charged}"
        )
    refunded = reserved - charged
    await conn.execute(sa.update(runs).where(runs.c.id == run_id).values(breakdown=items))
    await conn.execute(
        sa.update(orgs)
        .where(orgs.c.id == marked.org_id)
        .values(
            reserved_micros=orgs.c.reserved_micros - reserved,
            balance_micros=orgs.c.balance_micros - charged,
        )
    )
    await conn.execute(
        sa.insert(ledger),
        [
            {
                "org_id": marked.org_id,
                "run_id": run_id,
                "kind": "settle",
                "amount_micros": charged,
                "idempotency_key": f"{run_id}:settle",
                "note": None,
                "at": now,
            },
            {
                "org_id": marked.org_id,
                "run_id": run_id,
                "kind": "refund",
                "amount_micros": refunded,
                "idempotency_key": f"{run_id}:refund",
                "note": None,
                "at": now,
            },
        ],
    )
    return Settlement(
        reserved_micros=reserved, charged_micros=charged, refunded_micros=refunded, breakdown=items
    )


async def credit(conn: AsyncConnection, *, org_id: str, micros: int, note: str) -> None:
    """Add (or, negative, remove) money; never below what unsettled runs reserve."""
    if not isinstance(micros, int) or isinstance(micros, bool) or micros == 0:
        raise errors.InvalidRequest.field("micros", "must be a non-zero integer")
    if abs(micros) > MAX_MICROS:
        raise errors.InvalidRequest.field("micros", f"must be at most {MAX_MICROS} in size")
    done = await conn.execute(
        sa.update(orgs)
        .where(orgs.c.id == org_id, orgs.c.balance_micros + micros >= orgs.c.reserved_micros)
        .values(balance_micros=orgs.c.balance_micros + micros)
        .returning(orgs.c.id)
    )
    if done.first() is None:
        exists = await conn.scalar(sa.select(orgs.c.id).where(orgs.c.id == org_id))
        if exists is None:
            raise errors.NotFound(f"org {org_id} not found")
        raise errors.InvalidRequest.field(
            "micros", "would leave the balance below what running runs have reserved"
        )
    await conn.execute(
        sa.insert(ledger).values(
            org_id=org_id,
            run_id=None,
            kind="credit",
            amount_micros=micros,
            idempotency_key=new_id("credit"),
            note=note[:500] or None,
            at=utcnow(),
        )
    )
