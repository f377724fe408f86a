"""The store's two database backends, SQLite and PostgreSQL, as SQLAlchemy engines configured
so that concurrent writers serialise safely (the database's engine, not the run engine).

SQLite: WAL, a busy timeout, and ``BEGIN IMMEDIATE`` on every write transaction, so that a
read-then-write transaction holds the write lock from its first statement (otherwise two
writers that both read first deadlock on the upgrade and one gets SQLITE_BUSY at once).
The writers of one engine share a single connection: they wait their turn in the pool, in
order, instead of in SQLite's busy handler, which sleeps 1, 2, 5 … 100 ms between tries
whether or not the lock came free meanwhile (py-spy on a burst of 100 sessions found the
writer threads in ``sqlite3InvokeBusyHandler`` → ``usleep``). Other processes and engines on
the same file still meet the busy timeout. Pure reads run under a plain deferred ``BEGIN``
through :func:`reader`, a pool of their own, so that they never queue behind writers.
PostgreSQL: READ COMMITTED plus conditional ``UPDATE … RETURNING`` row locks, one pool.
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
    """The engine to read with: its transactions begin deferred, so reads never take the
    write lock. SQLite: its own pool on the same file; PostgreSQL: the same pool."""
    if engine.dialect.name != "sqlite":
        return engine.execution_options(**{READONLY: True})
    return _sqlite_engine(engine.url.render_as_string(hide_password=False), readers=True)


def _sqlite_engine(url: str, *, readers: bool = False) -> AsyncEngine:
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
        # SQLite has one writer: a second writing connection would only wait in the busy
        # handler. Readers in WAL mode run beside it and each other.
        pool_size=4 if readers else 1,
        max_overflow=4 if readers else 0,
        pool_timeout=120,
    )
    if readers:
        engine = engine.execution_options(**{READONLY: True})

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
