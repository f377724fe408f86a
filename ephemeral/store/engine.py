"""Engines for the two backends, configured so that concurrent writers serialise safely.

SQLite: WAL, a busy timeout, and ``BEGIN IMMEDIATE`` on every write transaction, so that a
read-then-write transaction holds the write lock from its first statement (otherwise two
writers that both read first deadlock on the upgrade and one gets SQLITE_BUSY at once).
Pure reads run under a plain deferred ``BEGIN`` through :func:`reader` so that they do not queue
behind writers. PostgreSQL: READ COMMITTED plus conditional ``UPDATE … RETURNING`` row locks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from ephemeral import errors

READONLY = "ephemeral_readonly"
SQLITE_BUSY_TIMEOUT_MS = 30_000


def create_engine(url: str) -> AsyncEngine:
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return _sqlite_engine(url)
    if backend == "postgresql":
        if parsed.drivername not in ("postgresql+asyncpg", "postgresql+psycopg"):
            raise errors.InvalidRequest.field(
                "database_url", "PostgreSQL URLs must use postgresql+asyncpg:// or +psycopg://"
            )
        return create_async_engine(url, pool_size=10, max_overflow=30, pool_pre_ping=True)
    raise errors.InvalidRequest.field(
        "database_url", f"unsupported backend {backend!r}: use sqlite+aiosqlite or postgresql"
    )


def reader(engine: AsyncEngine) -> AsyncEngine:
    """The same pool, but transactions begin deferred (SQLite) so reads never take the lock."""
    return engine.execution_options(**{READONLY: True})


def _sqlite_engine(url: str) -> AsyncEngine:
    parsed = make_url(url)
    if parsed.get_driver_name() != "aiosqlite":
        raise errors.InvalidRequest.field(
            "database_url", "SQLite URLs must use sqlite+aiosqlite://"
        )
    database = parsed.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        raise errors.InvalidRequest.field(
            "database_url", "SQLite needs a file path (the store is shared between connections)"
        )
    Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(
        url,
        connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        # SQLite has one writer; more connections only add busy-waiting.
        pool_size=4,
        max_overflow=4,
        pool_timeout=120,
    )

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control away from the driver so that the begin hook decides.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        # Erased content (DELETE /v1/runs/{id}) must not survive in free pages of the file.
        cur.execute("PRAGMA secure_delete=ON")
        cur.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        readonly = conn.get_execution_options().get(READONLY, False)
        conn.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")

    return engine
