"""The one transaction helper every repository of the store runs its work through.

A repository method is one unit of work: :meth:`Db.write` for anything that writes (committed
as it leaves, rolled back on an exception; on SQLite it holds the write lock from its first
statement), :meth:`Db.read` for a read that must never queue behind writers (see
:mod:`ephemeral.store.backends`). The statements themselves take the open connection, so that a
unit of work of one repository can call into another's (closing a run charges and appends).
Each repository is a :class:`Repository` over the one :class:`Db` its :class:`Store` owns.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ephemeral.store.backends import reader


class Db:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._reader = reader(engine)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def write(self) -> AbstractAsyncContextManager[AsyncConnection]:
        return self.engine.begin()

    def read(self) -> AbstractAsyncContextManager[AsyncConnection]:
        return self._reader.connect()

    async def close(self) -> None:
        await self.engine.dispose()
        if self._reader.sync_engine.pool is not self.engine.sync_engine.pool:
            await self._reader.dispose()


class Repository:
    """One concern of the store: its methods are units of work through :attr:`_db`."""

    def __init__(self, db: Db) -> None:
        self._db = db
