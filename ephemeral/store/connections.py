"""The ``connections`` table: per org, a name, a base URL and sealed credential headers.

:class:`Connections` is the repository (``store.connections``); each method is one unit of work
over the statements below, which take an open connection. Sealing and unsealing the headers is
the broker's job (:mod:`ephemeral.broker.secrets`); here they are an opaque string.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterable
from datetime import datetime

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict
from sqlalchemy.ext.asyncio import AsyncConnection

from ephemeral import errors
from ephemeral.ids import utcnow
from ephemeral.store import rows
from ephemeral.store.db import Repository
from ephemeral.store.schema import connections

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")  # the same rule as a policy's connection
MAX_SEALED_CHARS = 64 << 10


class StoredConnection(BaseModel):
    model_config = ConfigDict(frozen=True)

    org_id: str
    name: str
    base_url: str
    header_names: list[str]
    sealed_headers: str
    created_at: datetime


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise errors.InvalidRequest.field(
            "name", "must be 1-63 of a-z, 0-9, '_' or '-', starting with a letter or digit"
        )
    return name


async def add(
    conn: AsyncConnection,
    *,
    org_id: str,
    name: str,
    base_url: str,
    header_names: list[str],
    sealed_headers: str,
    replace: bool,
) -> StoredConnection:
    check_name(name)
    if not isinstance(base_url, str) or not 0 < len(base_url) <= 2048:
        raise errors.InvalidRequest.field("base_url", "must be 1-2048 characters")
    if not isinstance(sealed_headers, str) or len(sealed_headers) > MAX_SEALED_CHARS:
        raise errors.InvalidRequest.field("headers", f"seal to at most {MAX_SEALED_CHARS} chars")
    key = (connections.c.org_id == org_id, connections.c.name == name)
    exists = await conn.scalar(sa.select(connections.c.name).where(*key))
    if exists is not None:
        if not replace:
            raise errors.Conflict(f"connection {name!r} already exists (use --replace)")
        await conn.execute(sa.delete(connections).where(*key))
    row = (
        await conn.execute(
            sa.insert(connections)
            .values(
                org_id=org_id,
                name=name,
                base_url=base_url,
                header_names=list(header_names),
                sealed_headers=sealed_headers,
                created_at=utcnow(),
            )
            .returning(*connections.c)
        )
    ).one()
    return StoredConnection.model_validate(row._mapping)


async def get(conn: AsyncConnection, org_id: str, name: str) -> StoredConnection:
    row = (
        await conn.execute(
            sa.select(connections).where(connections.c.org_id == org_id, connections.c.name == name)
        )
    ).first()
    if row is None:
        raise errors.NotFound(f"connection {name!r} not found")
    return StoredConnection.model_validate(row._mapping)


async def list_for(conn: AsyncConnection, org_id: str) -> list[StoredConnection]:
    rows = await conn.execute(
        sa.select(connections).where(connections.c.org_id == org_id).order_by(connections.c.name)
    )
    return [StoredConnection.model_validate(r._mapping) for r in rows]


async def remove(conn: AsyncConnection, org_id: str, name: str) -> None:
    gone = await conn.execute(
        sa.delete(connections).where(connections.c.org_id == org_id, connections.c.name == name)
    )
    if not gone.rowcount:
        raise errors.NotFound(f"connection {name!r} not found")


async def missing(conn: AsyncConnection, org_id: str, names: Iterable[str]) -> list[str]:
    wanted = list(names)
    if not wanted:
        return []
    rows = await conn.execute(
        sa.select(connections.c.name).where(
            connections.c.org_id == org_id, connections.c.name.in_(wanted)
        )
    )
    have = {r[0] for r in rows}
    return [n for n in wanted if n not in have]


class Connections(Repository):
    async def add(
        self,
        org_id: str,
        name: str,
        *,
        base_url: str,
        header_names: list[str],
        sealed_headers: str,
        replace: bool = False,
    ) -> StoredConnection:
        async with self._db.write() as conn:
            org = await rows.org(conn, org_id)
            return await add(
                conn,
                org_id=org.id,
                name=name,
                base_url=base_url,
                header_names=header_names,
                sealed_headers=sealed_headers,
                replace=replace,
            )

    async def get(self, org_id: str, name: str) -> StoredConnection:
        async with self._db.read() as conn:
            return await get(conn, org_id, name)

    async def list(self, org_id: str) -> list[StoredConnection]:
        async with self._db.read() as conn:
            org = await rows.org(conn, org_id)
            return await list_for(conn, org.id)

    async def remove(self, org_id: str, name: str) -> None:
        async with self._db.write() as conn:
            org = await rows.org(conn, org_id)
            await remove(conn, org.id, name)

    async def missing(self, org_id: str, names: Iterable[str]) -> builtins.list[str]:
        """The names (in order) the org has no connection for."""
        async with self._db.read() as conn:
            return await missing(conn, org_id, names)
