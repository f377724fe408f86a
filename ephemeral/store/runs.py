"""Runs (``store.runs``): admission, the row, its status moves and its close.

A run changes status only through :meth:`Runs.transition` and :meth:`Runs.close`, each of
which writes the row and the events of that change together, guarded by the status the run
must be in and checked against the table of legal moves
(:data:`ephemeral.lifecycle.TRANSITIONS`). Closing charges compute, settles and keeps the
transcript in the same transaction, through the money and event statements.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import json
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from ephemeral import errors
from ephemeral.ids import RUN_ID_RE, utcnow
from ephemeral.lifecycle import (
    OPEN_STATUSES,
    STATUS_FOR_REASON,
    TERMINAL_STATUSES,
    RunStatus,
    TerminationReason,
    check_transition,
)
from ephemeral.store import events as events_
from ephemeral.store import ledger, money, rows
from ephemeral.store.db import Repository
from ephemeral.store.models import RunRow, Settlement
from ephemeral.store.schema import runs

MAX_PAGE = 100
LIFECYCLE_FIELDS = frozenset({"status", "termination_reason", "ended_at"})


def _encode_cursor(created_at: datetime, run_id: str) -> str:
    raw = json.dumps([created_at.isoformat(), run_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        stamp, run_id = json.loads(raw)
        created_at = datetime.fromisoformat(stamp)
        if created_at.tzinfo is None or not RUN_ID_RE.match(run_id):
            raise ValueError(cursor)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise errors.InvalidRequest.field("cursor", "is not a cursor this API returned") from exc
    return created_at, run_id


async def _cas(
    conn: AsyncConnection,
    run_id: str,
    expect: Collection[RunStatus],
    to: RunStatus,
    values: dict[str, Any],
) -> RunRow:
    """The one status write: a legal move (the table), applied only from ``expect``."""
    check_transition(expect, to)
    row = (
        await conn.execute(
            sa.update(runs)
            .where(runs.c.id == run_id, runs.c.status.in_(sorted(expect)))
            .values(**values)
            .returning(*runs.c)
        )
    ).first()
    if row is None:
        current = await rows.run(conn, run_id)
        raise errors.Conflict(f"run {run_id} is {current.status}, not one of {sorted(expect)}")
    return RunRow.model_validate(row._mapping)


class Runs(Repository):
    async def admit(
        self,
        *,
        org_id: str,
        run_id: str,
        model: str,
        prompt: str | None,
        policy: dict[str, Any],
        labels: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        body_hash: str | None = None,
        owner: str | None = None,
        kind: str | None = None,
        image_hash: str | None = None,
    ) -> tuple[RunRow, bool]:
        """Bind the idempotency key, reserve the budget, record the run and ``run.queued``.
        ``image_hash`` is the digest admission resolved a registry image to (its sandbox boots
        that one).

        All in one transaction: a refused admission leaves nothing behind, not even the key.
        The run is born with its ``owner``, so no recovery can take it for an orphan while the
        admitting process lives. Returns ``(run, replayed)``.
        """
        if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
            raise errors.InvalidRequest.field("run_id", "must be run_ + 32 lowercase hex digits")
        if not isinstance(policy, dict):
            raise errors.InvalidRequest.field("policy", "must be an object")
        rows.json_size("policy", policy, 16 << 20)
        rows.json_size("labels", labels or {}, 64 << 10)
        if not isinstance(model, str) or not 0 < len(model) <= 200:
            raise errors.InvalidRequest.field("model", "must be 1-200 characters")
        try:
            async with self._db.write() as conn:
                admitted = await ledger.admit(
                    conn,
                    org_id=org_id,
                    run_id=run_id,
                    model=model,
                    prompt=prompt,
                    policy=policy,
                    labels=labels or {},
                    idempotency_key=idempotency_key,
                    body_hash=body_hash,
                    owner=owner,
                    kind=kind,
                    image_hash=image_hash,
                )
                if isinstance(admitted, str):  # replayed: the run its key admitted earlier
                    return await rows.run(conn, admitted), True
        except sa.exc.IntegrityError as exc:
            # Only a reused run id gets here: money and keys are checked before inserting.
            raise errors.Conflict(
                f"run {run_id} could not be recorded: {exc.orig}", cause=exc
            ) from exc
        return RunRow.model_validate(admitted._mapping), False

    async def get(self, run_id: str, org_id: str | None = None) -> RunRow:
        """The run; another org's run is NotFound, exactly like a missing one."""
        async with self._db.read() as conn:
            return await rows.run(conn, run_id, org_id)

    async def list(
        self,
        org_id: str,
        *,
        status: str | None = None,
        limit: int = 20,
        cursor: str | None = None,
    ) -> tuple[list[RunRow], str | None]:
        """Newest first; the second value is the cursor of the next page, or None at the end."""
        if not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
            raise errors.InvalidRequest.field("limit", f"must be between 1 and {MAX_PAGE}")
        if status is not None and status not in rows.RUN_STATUSES:
            raise errors.InvalidRequest.field(
                "status", f"must be one of {', '.join(sorted(rows.RUN_STATUSES))}"
            )
        # sandbox sessions (kind 'session') are listed by their own API, not as runs
        query = sa.select(runs).where(runs.c.org_id == org_id, runs.c.kind.is_(None))
        if status is not None:
            query = query.where(runs.c.status == status)
        if cursor:
            created_at, last_id = _decode_cursor(cursor)
            query = query.where(
                sa.or_(
                    runs.c.created_at < created_at,
                    sa.and_(runs.c.created_at == created_at, runs.c.id < last_id),
                )
            )
        query = query.order_by(runs.c.created_at.desc(), runs.c.id.desc()).limit(limit + 1)
        async with self._db.read() as conn:
            found = [RunRow.model_validate(r._mapping) for r in await conn.execute(query)]
        if len(found) <= limit:
            return found, None
        page = found[:limit]
        return page, _encode_cursor(page[-1].created_at, page[-1].id)

    async def update(self, run_id: str, **fields: Any) -> RunRow:
        """Set run fields other than its lifecycle (and money: ``store.money``).

        The status, the termination reason and ``ended_at`` change only through
        ``transition`` and ``close``, which write the events of the change with it.
        """
        moved = sorted(set(fields) & LIFECYCLE_FIELDS)
        if moved:
            raise errors.InvalidRequest.field(
                moved[0],
                "changes only with the run's status (store.runs.transition, store.runs.close)",
            )
        values = rows.run_values(fields)
        async with self._db.write() as conn:
            if not values:
                return await rows.run(conn, run_id)
            row = (
                await conn.execute(
                    sa.update(runs).where(runs.c.id == run_id).values(**values).returning(*runs.c)
                )
            ).first()
            if row is None:
                raise errors.NotFound(f"run {run_id} not found")
        return RunRow.model_validate(row._mapping)

    async def transition(
        self,
        run_id: str,
        *,
        expect: Collection[RunStatus],
        to: RunStatus,
        events: Sequence[tuple[str, dict[str, Any]]] = (),
        **fields: Any,
    ) -> RunRow:
        """Move a run to the open status ``to`` with ``fields`` and ``events``, atomically.

        Applies only while the run is in one of ``expect`` (compare-and-set); otherwise Conflict
        and nothing is written. A move the table forbids is IllegalTransition, whatever the run's
        status. A run ends through :meth:`close`, never here.
        """
        if to not in OPEN_STATUSES:
            raise errors.InvalidRequest.field("status", f"{to!r} is not an open status")
        values = rows.run_values({**fields, "status": to})
        events_.check(events)
        async with self._db.write() as conn:
            row = await _cas(conn, run_id, expect, to, values)
            if events:
                await events_.append_many(conn, run_id, events)
        return row

    async def close(
        self,
        run_id: str,
        *,
        reason: TerminationReason,
        detail: str | None,
        usage: dict[str, Any],
        output: str | None,
        keep_output: bool = True,
        expect: Collection[RunStatus] = OPEN_STATUSES,
        compute: tuple[int, int] | None = None,
        transcript: builtins.list[dict[str, Any]] | None = None,
    ) -> tuple[RunRow, Settlement]:
        """End an open run and settle it: one transaction, or nothing at all.

        Marks the run terminal (only if it is still open); charges ``compute`` (micros,
        lifetime in ms: its sandbox's) under the key ``<run>:compute`` with ``sandbox.destroyed``
        (skipped if that key was charged already); appends ``run.<status>``; settles the
        reservation from what was charged; appends ``run.output`` (if any) and ``run.settled``;
        keeps ``transcript`` (the model messages; not under zero data retention).
        A run that is already terminal is left as it is, except that one a crash left
        unsettled (by an older version, which closed in several steps) is settled now.
        ``expect`` narrows the statuses it closes from (a cancel of a ``queued`` run must not
        close one a worker claimed meanwhile): Conflict if the run is open but not in it.
        """
        reason = TerminationReason(reason)
        status = STATUS_FOR_REASON[reason]
        values = rows.run_values(
            {
                "status": status,
                "ended_at": utcnow(),
                "termination_reason": reason,
                "termination_detail": detail,
                "usage": usage,
                "output": output if keep_output else None,
            }
        )
        tokens = int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
        if transcript is not None:
            events_.check_transcript(transcript)
        async with self._db.write() as conn:
            try:
                await _cas(conn, run_id, expect, status, values)
            except errors.Conflict:
                current = await rows.run(conn, run_id)
                if current.status in OPEN_STATUSES:
                    raise
                if current.settled:
                    return current, await ledger.settle(conn, run_id)
                output = None  # closed earlier: only the settlement is missing
            else:
                if compute is not None:
                    await money.charge(
                        conn,
                        run_id,
                        "compute",
                        compute[0],
                        f"{run_id}:compute",
                        ("sandbox.destroyed", {"lifetime_ms": compute[1]}),
                    )
                if transcript is not None:
                    await events_.save_transcript(conn, run_id, transcript)
                await events_.append(
                    conn,
                    run_id,
                    f"run.{status}",
                    {
                        "model_calls": int(usage.get("model_calls", 0)),
                        "tokens": tokens,
                        "reason": str(reason),
                    },
                )
            settlement = await ledger.settle(conn, run_id)
            if output is not None:
                await events_.append(conn, run_id, "run.output", {"markdown": output})
            await events_.append(
                conn,
                run_id,
                "run.settled",
                {
                    "charged_micros": settlement.charged_micros,
                    "refunded_micros": settlement.refunded_micros,
                    "breakdown": settlement.breakdown,
                },
            )
            return await rows.run(conn, run_id), settlement

    async def open(self) -> builtins.list[RunRow]:
        """Runs not yet in a terminal status (what crash recovery has to finish)."""
        async with self._db.read() as conn:
            return await rows.runs_where(conn, runs.c.status.not_in(sorted(TERMINAL_STATUSES)))

    async def unsettled(self) -> builtins.list[RunRow]:
        """Terminal runs whose reservation was never settled (a crash between the two)."""
        async with self._db.read() as conn:
            return await rows.runs_where(
                conn, runs.c.status.in_(sorted(TERMINAL_STATUSES)), runs.c.settled_at.is_(None)
            )

    async def unrecorded(self) -> builtins.list[RunRow]:
        """Settled runs whose records were never written (a crash between close and record)."""
        async with self._db.read() as conn:
            return await rows.runs_where(
                conn, runs.c.settled_at.is_not(None), runs.c.recorded_at.is_(None)
            )

    async def mark_recorded(self, run_id: str) -> None:
        """The run's records are written: recovery leaves it."""
        async with self._db.write() as conn:
            await conn.execute(
                sa.update(runs).where(runs.c.id == run_id).values(recorded_at=utcnow())
            )
