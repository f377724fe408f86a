"""The directory of worker hosts that take sandbox sessions (``worker_hosts``).

Each ``ephemeral worker`` registers its internal channel's address and process, and renews the
row like a lease; API processes place sessions on hosts whose row has not expired. The
repository is ``store.hosts``.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict

from ephemeral.lifecycle import TERMINAL_STATUSES
from ephemeral.store import ledger, rows
from ephemeral.store.db import Repository
from ephemeral.store.schema import runs, worker_hosts


class HostRow(BaseModel):
    model_config = ConfigDict(frozen=True)

    host: str
    address: str
    instance: str
    session_slots: int
    sessions_live: int
    heartbeat_at: datetime
    expires_at: datetime

    @property
    def free(self) -> int:
        return self.session_slots - self.sessions_live


class Hosts(Repository):
    async def register(
        self,
        *,
        host: str,
        address: str,
        instance: str,
        session_slots: int,
        sessions_live: int,
        now: datetime,
        expires_at: datetime,
    ) -> None:
        """Insert or replace this host's row (a restarted host takes over its name)."""
        values = {
            "address": address,
            "instance": instance,
            "session_slots": session_slots,
            "sessions_live": sessions_live,
            "heartbeat_at": now,
            "expires_at": expires_at,
        }
        async with self._db.write() as conn:
            stmt = ledger.insert(conn, worker_hosts).values(host=host, **values)
            await conn.execute(
                stmt.on_conflict_do_update(index_elements=[worker_hosts.c.host], set_=values)
            )

    async def heartbeat(
        self,
        *,
        host: str,
        instance: str,
        sessions_live: int,
        now: datetime,
        expires_at: datetime,
    ) -> bool:
        """Renew this process's row; False if another process of the same name replaced it."""
        async with self._db.write() as conn:
            done = await conn.execute(
                sa.update(worker_hosts)
                .where(worker_hosts.c.host == host, worker_hosts.c.instance == instance)
                .values(sessions_live=sessions_live, heartbeat_at=now, expires_at=expires_at)
            )
        return bool(done.rowcount)

    async def unregister(self, *, host: str, instance: str) -> None:
        async with self._db.write() as conn:
            await conn.execute(
                sa.delete(worker_hosts).where(
                    worker_hosts.c.host == host, worker_hosts.c.instance == instance
                )
            )

    async def live(self, now: datetime) -> list[HostRow]:
        """Hosts whose row has not expired, most free slots first."""
        async with self._db.read() as conn:
            rows = await conn.execute(
                sa.select(worker_hosts).where(worker_hosts.c.expires_at >= now)
            )
            found = [HostRow.model_validate(r._mapping) for r in rows]
        return sorted(found, key=lambda h: (-h.free, h.host))

    async def get(self, host: str) -> HostRow | None:
        async with self._db.read() as conn:
            row = (
                await conn.execute(sa.select(worker_hosts).where(worker_hosts.c.host == host))
            ).first()
        return None if row is None else HostRow.model_validate(row._mapping)

    async def ended_among(self, run_ids: set[str]) -> list[str]:
        """Which of these runs or sessions are over (another process may have settled them)."""
        if not run_ids:
            return []
        async with self._db.read() as conn:
            return await rows.ids_among(conn, run_ids, runs.c.status.in_(sorted(TERMINAL_STATUSES)))
