"""What the store keeps only for a while: a zero-data-retention run's sealed prompt and output
for their one reader (``store.sealed``), and a run's content until its retention ends or its
erasure (``store.retention``), with the idempotency keys of admissions.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from ephemeral import errors
from ephemeral.events import redact_for_zdr
from ephemeral.ids import utcnow
from ephemeral.lifecycle import TERMINAL_STATUSES
from ephemeral.store import ledger, rows
from ephemeral.store.db import Repository
from ephemeral.store.schema import idempotency, run_events, run_transcripts, runs, sealed_content

IDEMPOTENCY_RETENTION = timedelta(hours=24)


class Sealed(Repository):
    async def put(self, run_id: str, kind: str, sealed: str, expires_at: datetime) -> None:
        """Keep a sealed zero-data-retention prompt or output for its one reader."""
        async with self._db.write() as conn:
            stmt = ledger.insert(conn, sealed_content).values(
                run_id=run_id, kind=kind, sealed=sealed, expires_at=expires_at
            )
            await conn.execute(
                stmt.on_conflict_do_update(
                    index_elements=[sealed_content.c.run_id, sealed_content.c.kind],
                    set_={"sealed": stmt.excluded.sealed, "expires_at": stmt.excluded.expires_at},
                )
            )

    async def take(self, run_id: str, kind: str) -> str | None:
        """Delete and return it: of two readers in any processes, exactly one gets it."""
        async with self._db.write() as conn:
            row = (
                await conn.execute(
                    sa.delete(sealed_content)
                    .where(
                        sealed_content.c.run_id == run_id,
                        sealed_content.c.kind == kind,
                        sealed_content.c.expires_at >= utcnow(),
                    )
                    .returning(sealed_content.c.sealed)
                )
            ).first()
        return None if row is None else str(row[0])

    async def purge(self, now: datetime) -> int:
        """Delete sealed content nobody read before it expired."""
        async with self._db.write() as conn:
            gone = await conn.execute(
                sa.delete(sealed_content).where(sealed_content.c.expires_at < now)
            )
        return int(gone.rowcount or 0)


class Retention(Repository):
    async def erase(self, run_id: str) -> None:
        """Remove prompt, output, transcript and event content; money and usage stay."""
        async with self._db.write() as conn:
            await rows.run(conn, run_id)
            await conn.execute(
                sa.update(runs)
                .where(runs.c.id == run_id)
                .values(prompt=None, output=None, erased_at=utcnow())
            )
            await conn.execute(sa.delete(run_transcripts).where(run_transcripts.c.run_id == run_id))
            await conn.execute(sa.delete(sealed_content).where(sealed_content.c.run_id == run_id))
            found = await conn.execute(
                sa.select(run_events.c.seq, run_events.c.data).where(run_events.c.run_id == run_id)
            )
            for seq, data in found.all():
                redacted = redact_for_zdr(data)
                if redacted != data:
                    await conn.execute(
                        sa.update(run_events)
                        .where(run_events.c.run_id == run_id, run_events.c.seq == seq)
                        .values(data=redacted)
                    )
        if self._db.dialect == "sqlite":
            # Old page images of the erased rows linger in the WAL until a checkpoint.
            # It must run outside a transaction, so it bypasses SQLAlchemy's begin hook.
            async with self._db.engine.connect() as conn:
                raw = await conn.get_raw_connection()
                driver: Any = raw.driver_connection
                await driver.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    async def expired(self, older_than: timedelta) -> list[str]:
        """Finished runs past retention whose content has not been erased yet."""
        cutoff = utcnow() - older_than
        async with self._db.read() as conn:
            found = await conn.execute(
                sa.select(runs.c.id).where(
                    runs.c.status.in_(sorted(TERMINAL_STATUSES)),
                    runs.c.ended_at < cutoff,
                    runs.c.erased_at.is_(None),
                )
            )
            return [r[0] for r in found.all()]

    async def purge_idempotency(self, older_than: timedelta = IDEMPOTENCY_RETENTION) -> int:
        """Forget idempotency keys older than ``older_than`` (never less than 24 h)."""
        if older_than < IDEMPOTENCY_RETENTION:
            raise errors.InvalidRequest.field("older_than", "idempotency keys are kept >= 24 h")
        async with self._db.write() as conn:
            gone = await conn.execute(
                sa.delete(idempotency).where(idempotency.c.created_at < utcnow() - older_than)
            )
        return int(gone.rowcount or 0)
