"""What the processes of a cluster share about runs in flight: run leases (``store.leases``),
the admission outbox a worker takes runs from (``store.outbox``), cancel requests to the
process executing a run (``store.cancels``) and facts every process agrees on
(``store.facts``). The directory of worker hosts is :mod:`ephemeral.store.hosts`.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

import sqlalchemy as sa

from ephemeral.ids import utcnow
from ephemeral.lifecycle import OPEN_STATUSES, RunStatus
from ephemeral.store import ledger, rows
from ephemeral.store.db import Repository
from ephemeral.store.models import RunRow
from ephemeral.store.schema import cluster_facts, process_leases, runs


class Leases(Repository):
    """A run's lease: renewed by the process executing it while its host lives."""

    async def renew(
        self,
        run_ids: Collection[str],
        *,
        owner: str,
        renewed_at: datetime,
        expires_at: datetime,
    ) -> None:
        """Extend the leases of these open runs that ``owner`` owns (its host is alive). A
        run it does not own (yet, or any more: handed back, let go) is left alone: a renewal
        must never put a lease on a row nobody owns, which would expire as a host's death."""
        if not run_ids:
            return
        async with self._db.write() as conn:
            await conn.execute(
                sa.update(runs)
                .where(
                    runs.c.id.in_(sorted(run_ids)),
                    runs.c.owner == owner,
                    runs.c.status.in_(sorted(OPEN_STATUSES)),
                )
                .values(lease_renewed_at=renewed_at, lease_expires_at=expires_at)
            )

    async def expired(self, now: datetime) -> list[RunRow]:
        """Open runs whose executing host stopped renewing their lease before ``now``, and
        whose owning process's lease (ephemeral.cluster.leases) has lapsed too: a late run
        renewal of a live process is not its death."""
        owner_alive = sa.exists().where(
            process_leases.c.owner == runs.c.owner, process_leases.c.expires_at >= now
        )
        async with self._db.read() as conn:
            return await rows.runs_where(
                conn,
                runs.c.status.in_(sorted(OPEN_STATUSES)),
                runs.c.lease_expires_at < now,
                ~owner_alive,
            )

    async def let_go(self, run_id: str, owner: str, now: datetime) -> bool:
        """This owner will not execute the run it owns: disown it with its lease ended, so
        that the next sweep of any process settles it (its live process lease no longer
        covers it). False if it is not this owner's or no longer open."""
        async with self._db.write() as conn:
            done = await conn.execute(
                sa.update(runs)
                .where(
                    runs.c.id == run_id,
                    runs.c.owner == owner,
                    runs.c.status.in_(sorted(OPEN_STATUSES)),
                )
                .values(owner=None, lease_expires_at=now)
            )
        return bool(done.rowcount)


class Outbox(Repository):
    """Runs admitted and waiting for a worker: handed over to Prefect, taken, handed back."""

    async def mark_dispatched(self, run_id: str, generation: int) -> None:
        """Its task run of hand-over ``generation`` exists in Prefect now."""
        async with self._db.write() as conn:
            await conn.execute(
                sa.update(runs)
                .where(
                    runs.c.id == run_id,
                    sa.func.coalesce(runs.c.dispatches, 0) == generation,
                    runs.c.dispatched_at.is_(None),
                )
                .values(dispatched_at=utcnow())
            )

    async def undispatched(self, created_before: datetime) -> list[RunRow]:
        """Runs waiting for a worker that no Prefect task run is known to carry: admitted by a
        process that died before (or while) handing them over, or handed back by a drain."""
        async with self._db.read() as conn:
            return await rows.runs_where(
                conn,
                runs.c.status == RunStatus.QUEUED,
                runs.c.owner.is_(None),
                runs.c.kind.is_(None),
                runs.c.dispatched_at.is_(None),
                runs.c.created_at < created_before,
            )

    async def take(
        self, run_id: str, *, host: str, owner: str, renewed_at: datetime, expires_at: datetime
    ) -> bool:
        """A worker takes the run its task run handed over and keeps it, still ``queued``,
        until it has a slot: it carries this host, owner and a lease. False if it no longer
        waits."""
        async with self._db.write() as conn:
            done = await conn.execute(
                sa.update(runs)
                .where(runs.c.id == run_id, runs.c.status == RunStatus.QUEUED)
                .values(
                    host=host,
                    owner=owner,
                    lease_renewed_at=renewed_at,
                    lease_expires_at=expires_at,
                )
            )
        return bool(done.rowcount)

    async def release(self, run_id: str, owner: str) -> int | None:
        """Hand a run this owner took (or received untaken) but never started back to the queue
        (a draining worker): no host, owner or lease, not dispatched, under the next hand-over
        number, which is returned; None if it is no longer ``queued`` and this owner's."""
        async with self._db.write() as conn:
            row = (
                await conn.execute(
                    sa.update(runs)
                    .where(
                        runs.c.id == run_id,
                        runs.c.status == RunStatus.QUEUED,
                        sa.or_(runs.c.owner == owner, runs.c.owner.is_(None)),
                    )
                    .values(
                        host=None,
                        owner=None,
                        lease_renewed_at=None,
                        lease_expires_at=None,
                        dispatched_at=None,
                        dispatches=sa.func.coalesce(runs.c.dispatches, 0) + 1,
                    )
                    .returning(runs.c.dispatches)
                )
            ).first()
        return None if row is None else int(row[0])


class Cancels(Repository):
    """Requests to cancel a run, read by the process executing it."""

    async def request(self, run_id: str) -> bool:
        """Flag an open run for cancellation by the host executing it; False if it ended."""
        async with self._db.write() as conn:
            done = await conn.execute(
                sa.update(runs)
                .where(runs.c.id == run_id, runs.c.status.in_(sorted(OPEN_STATUSES)))
                .values(cancel_requested_at=sa.func.coalesce(runs.c.cancel_requested_at, utcnow()))
            )
        return bool(done.rowcount)

    async def requested(self, run_ids: Collection[str]) -> list[str]:
        """Which of these runs some process asked to cancel."""
        if not run_ids:
            return []
        async with self._db.read() as conn:
            return await rows.ids_among(conn, run_ids, runs.c.cancel_requested_at.is_not(None))


class Facts(Repository):
    """Values every process of a cluster agrees on (ephemeral.cluster.sharing): the first
    one stored."""

    async def put_first(self, name: str, value: str) -> str:
        """Store ``value`` under ``name`` unless some process did first; returns the stored one."""
        async with self._db.write() as conn:
            stmt = ledger.insert(conn, cluster_facts).values(
                name=name, value=value, created_at=utcnow()
            )
            await conn.execute(stmt.on_conflict_do_nothing(index_elements=[cluster_facts.c.name]))
            row = (
                await conn.execute(
                    sa.select(cluster_facts.c.value).where(cluster_facts.c.name == name)
                )
            ).first()
        assert row is not None
        return str(row[0])
