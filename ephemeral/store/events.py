"""A run's event log (``store.events``) and its model transcript (``store.transcripts``).

Events are numbered 1, 2, 3… per run with no gaps: an append bumps the run's counter (which
row-locks the run, so concurrent appends queue) and inserts its events in the same transaction.
Under zero data retention, or once the run's content was erased, what is stored is redacted to
sizes (DESIGN §4); delivering content live is the caller's job. :func:`append_many` and
:func:`save_transcript` take an open connection, so that a unit of work of another repository
(a transition, a close, a charge) writes its events with it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from ephemeral import errors
from ephemeral.events import Event, redact_for_zdr
from ephemeral.ids import rfc3339, utcnow
from ephemeral.store import ledger, rows
from ephemeral.store.db import Repository
from ephemeral.store.schema import run_events, run_transcripts, runs

EVENT_TYPE_RE = re.compile(r"^[a-z][a-z_]*(\.[a-z][a-z_]*)+$")
MAX_EVENT_BYTES = 1 << 20
MAX_TRANSCRIPT_BYTES = 32 << 20
# An event's two statements, built once (see ledger's charge statements for why). The counter
# moves by as many events as are appended together; the last of their numbers comes back.
_BUMP_SEQ = (
    sa.update(runs)
    .where(runs.c.id == sa.bindparam("b_run_id"))
    .values(last_seq=runs.c.last_seq + sa.bindparam("b_n", type_=sa.Integer))
    .returning(runs.c.last_seq, runs.c.policy, runs.c.erased_at)
)
# The same bump setting the run's usage too (a session's exec counts in the same statement).
_BUMP_SEQ_USAGE = _BUMP_SEQ.values(usage=sa.bindparam("b_usage", type_=runs.c.usage.type))
_INSERT_EVENT = sa.insert(run_events)


def check(events: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """Each ``(type, data)`` a well-formed event, before any unit of work begins."""
    for type_, data in events:
        if not isinstance(type_, str) or not EVENT_TYPE_RE.match(type_) or len(type_) > 64:
            raise errors.InvalidRequest.field("type", f"{type_!r} is not an event type")
        if not isinstance(data, dict):
            raise errors.InvalidRequest.field("data", "must be an object")
        rows.json_size("data", data, MAX_EVENT_BYTES)


async def append_many(
    conn: AsyncConnection,
    run_id: str,
    events: Sequence[tuple[str, dict[str, Any]]],
    *,
    usage: dict[str, Any] | None = None,
) -> list[Event]:
    """Events in order, numbered next: one bump of the counter (which also sets the run's
    ``usage`` when given) and one INSERT for all of them."""
    params: dict[str, Any] = {"b_run_id": run_id, "b_n": len(events)}
    if usage is not None:
        params["b_usage"] = usage
    bump = _BUMP_SEQ if usage is None else _BUMP_SEQ_USAGE
    bumped = (await conn.execute(bump, params)).first()
    if bumped is None:
        raise errors.NotFound(f"run {run_id} not found")
    redacted = rows.zdr(bumped.policy) or bumped.erased_at is not None
    first = bumped.last_seq - len(events) + 1
    at = rfc3339(utcnow())
    out = [
        Event(
            seq=first + i,
            run_id=run_id,
            type=type_,
            at=at,
            data=redact_for_zdr(data) if redacted else data,
        )
        for i, (type_, data) in enumerate(events)
    ]
    values = [
        {"run_id": run_id, "seq": e.seq, "type": e.type, "at": at, "data": e.data} for e in out
    ]
    await conn.execute(_INSERT_EVENT, values if len(values) > 1 else values[0])
    return out


async def append(conn: AsyncConnection, run_id: str, type: str, data: dict[str, Any]) -> Event:
    return (await append_many(conn, run_id, [(type, data)]))[0]


class Events(Repository):
    async def append(
        self, run_id: str, type: str, data: dict[str, Any], *, usage: dict[str, Any] | None = None
    ) -> Event:
        """Append with the next ``seq`` of the run; ``usage``, if given, becomes the run's
        usage in the same transaction."""
        check([(type, data)])
        if usage is not None:
            rows.run_values({"usage": usage})
        async with self._db.write() as conn:
            return (await append_many(conn, run_id, [(type, data)], usage=usage))[0]

    async def list(self, run_id: str, after_seq: int = 0, limit: int | None = None) -> list[Event]:
        query = (
            sa.select(run_events)
            .where(run_events.c.run_id == run_id, run_events.c.seq > after_seq)
            .order_by(run_events.c.seq)
        )
        if limit is not None:
            query = query.limit(limit)
        async with self._db.read() as conn:
            found = (await conn.execute(query)).all()
            if not found:
                await rows.run(conn, run_id)  # NotFound for a run that does not exist
        return [
            Event(seq=r.seq, run_id=r.run_id, type=r.type, at=r.at, data=dict(r.data))
            for r in found
        ]


def check_transcript(messages: object) -> None:
    if not isinstance(messages, list):
        raise errors.InvalidRequest.field("messages", "must be a list")
    rows.json_size("messages", messages, MAX_TRANSCRIPT_BYTES)


async def save_transcript(
    conn: AsyncConnection, run_id: str, messages: list[dict[str, Any]]
) -> None:
    run = await rows.run(conn, run_id)
    if rows.zdr(run.policy) or run.erased_at is not None:
        return
    stmt = ledger.insert(conn, run_transcripts).values(
        run_id=run_id, messages=messages, updated_at=utcnow()
    )
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[run_transcripts.c.run_id],
            set_={"messages": stmt.excluded.messages, "updated_at": stmt.excluded.updated_at},
        )
    )


class Transcripts(Repository):
    async def save(self, run_id: str, messages: list[dict[str, Any]]) -> None:
        """Keep the model messages; a no-op under zero data retention or after erasure."""
        check_transcript(messages)
        async with self._db.write() as conn:
            await save_transcript(conn, run_id, messages)

    async def get(self, run_id: str) -> list[dict[str, Any]] | None:
        async with self._db.read() as conn:
            found = await conn.scalar(
                sa.select(run_transcripts.c.messages).where(run_transcripts.c.run_id == run_id)
            )
        return None if found is None else list(found)
