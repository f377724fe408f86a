"""The operational store: the database and its repositories, one concern each.

One :class:`Store` per process, opened with the settings' ``db_url`` and passed down. It owns
the database (:class:`~ephemeral.store.db.Db`, the one transaction helper: every repository
method is one unit of work through it) and exposes the repositories as attributes, so a caller
names the concern it means (``store.runs.get(run_id)``):

    orgs, keys           orgs (with their credit) and members' API keys       orgs.py
    connections          an org's sealed connections                          connections.py
    runs                 admission, the row, status moves, the close          runs.py
    events, transcripts  a run's event log and its model messages             events.py
    money                charges inside a run's reservation, settlement       money.py
    leases, outbox,      run leases, runs waiting for a worker, cancel        cluster.py
    cancels, facts       requests, facts every process agrees on
    hosts                the directory of worker hosts                        hosts.py
    sealed, retention    sealed ZDR content, erasure, expiry, idempotency     retention.py

The statements of money moves are :mod:`ephemeral.store.ledger`'s; those a unit of work of one
repository needs from another's (a close charges, appends and keeps the transcript) take the
open connection.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from ephemeral import errors
from ephemeral.store.backends import create_engine
from ephemeral.store.cluster import Cancels, Facts, Leases, Outbox
from ephemeral.store.connections import Connections
from ephemeral.store.db import Db
from ephemeral.store.events import Events, Transcripts
from ephemeral.store.hosts import Hosts
from ephemeral.store.money import Money
from ephemeral.store.orgs import Keys, Orgs
from ephemeral.store.retention import Retention, Sealed
from ephemeral.store.runs import Runs
from ephemeral.store.schema import metadata, upgrade


class Store:
    def __init__(self, engine: AsyncEngine) -> None:
        self.db = Db(engine)
        self.orgs = Orgs(self.db)
        self.keys = Keys(self.db)
        self.connections = Connections(self.db)
        self.runs = Runs(self.db)
        self.events = Events(self.db)
        self.transcripts = Transcripts(self.db)
        self.money = Money(self.db)
        self.leases = Leases(self.db)
        self.outbox = Outbox(self.db)
        self.cancels = Cancels(self.db)
        self.facts = Facts(self.db)
        self.hosts = Hosts(self.db)
        self.sealed = Sealed(self.db)
        self.retention = Retention(self.db)

    @property
    def engine(self) -> AsyncEngine:
        return self.db.engine

    @property
    def dialect(self) -> str:
        return self.db.dialect

    @classmethod
    async def open(cls, url: str) -> Store:
        engine = create_engine(url)
        try:
            async with engine.begin() as conn:
                if conn.dialect.name == "postgresql":
                    # Several processes may open a fresh database at once; CREATE TABLE races.
                    await conn.execute(sa.text("SELECT pg_advisory_xact_lock(7263501)"))
                await conn.run_sync(metadata.create_all)
                await conn.run_sync(upgrade)
        except (OSError, sa.exc.DBAPIError) as exc:
            await engine.dispose()
            shown = sa.make_url(url).render_as_string(hide_password=True)
            raise errors.EphemeralError(
                f"cannot open the store at {shown}: {exc}", cause=exc
            ) from exc
        return cls(engine)

    async def close(self) -> None:
        await self.db.close()
