"""A worker process's lease on the store: the proof that it is alive, apart from its runs.

Every run a worker owns carries a lease on its row (``runs.lease_expires_at``), renewed by the
runtime's run watcher (ephemeral.engine.runtime) and used to charge compute up to the host's death
(ephemeral.engine.close). Those renewals share the run rows with everything else a run writes and
share the worker's event loop with its sandboxes, so under load one can be seconds late.
Measured on 2 cores at load 6-80 (tests/cluster, 5 s leases): renewal ``UPDATE``\\s that took
1-3.5 s to commit, and a run settled as "its host died" while its host was alive and well.

So a run's lease counts as expired only once its owner's *process lease* has lapsed too
(``store.leases.expired``). That lease is one row per process, which
nothing else writes, renewed every third of the lease from a thread of its own with its own
connection, so neither a busy event loop nor a run row's lock delays it. It is renewed only
while the process's event loop still turns (a ticker on the loop marks each turn): a process
whose loop is wedged for a whole lease stops renewing, and its runs are settled by the others
as before. A run the process lets go of on purpose is disowned (``store.leases.let_go``), so that
the process lease no longer covers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from ephemeral.clock import SYSTEM, Clock
from ephemeral.store import ledger
from ephemeral.store.backends import create_engine
from ephemeral.store.schema import process_leases

log = logging.getLogger("ephemeral.cluster.leases")

TICK_SECONDS = 0.25  # how often the event loop marks that it turns


async def renew(
    engine: AsyncEngine,
    owner: str,
    host: str,
    lease_seconds: float,
    *,
    turned: float | None = None,
    clock: Clock = SYSTEM,
) -> None:
    """``turned``: the ``clock.monotonic()`` of the loop's last turn, when the process was last
    seen alive. The lease runs from then, not from this write: a renewal that is late (a
    starved thread, a busy store) cannot carry a loop that wedged meanwhile past one lease."""
    now = clock.now()
    alive_for = 0.0 if turned is None else max(0.0, clock.monotonic() - turned)
    expires = now + timedelta(seconds=lease_seconds - alive_for)
    values = {"host": host, "renewed_at": now, "expires_at": expires}
    async with engine.begin() as conn:
        stmt = ledger.insert(conn, process_leases).values(owner=owner, **values)
        await conn.execute(
            stmt.on_conflict_do_update(index_elements=[process_leases.c.owner], set_=values)
        )


async def drop(engine: AsyncEngine, owner: str) -> None:
    """This process ends: its lease goes at once (its runs, if any are left, are then settled
    by the next sweep of any process, at their own run lease)."""
    async with engine.begin() as conn:
        await conn.execute(sa.delete(process_leases).where(process_leases.c.owner == owner))


async def purge(engine: AsyncEngine, before: float = 86_400.0, clock: Clock = SYSTEM) -> None:
    """Forget the leases of processes that died more than ``before`` seconds ago."""
    async with engine.begin() as conn:
        await conn.execute(
            sa.delete(process_leases).where(
                process_leases.c.expires_at < clock.now() - timedelta(seconds=before)
            )
        )


class ProcessLease:
    """Hold this process's lease from :meth:`start` until :meth:`stop`."""

    def __init__(
        self, db_url: str, owner: str, host: str, lease_seconds: float, clock: Clock = SYSTEM
    ) -> None:
        self.db_url, self.owner, self.host = db_url, owner, host
        self.lease_seconds = lease_seconds
        self.clock = clock
        self.renewals = 0
        self.stalls = 0  # renewals not made: the event loop had not turned for a whole lease
        self._turned = clock.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    async def start(self) -> None:
        """Start the ticker on this event loop and the renewing thread; returns once the first
        renewal is committed (so a run taken or claimed after this is covered)."""
        self._turned = self.clock.monotonic()
        self._ticker = asyncio.create_task(self._tick(), name="process-lease-tick")
        self._thread = threading.Thread(target=self._main, name="process-lease", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._ready.wait)
        if self._error is not None:
            raise self._error

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(BaseException):
                await self._ticker
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    async def _tick(self) -> None:
        while True:
            self._turned = self.clock.monotonic()
            await self.clock.sleep(TICK_SECONDS)

    def _main(self) -> None:
        asyncio.run(self._renew_forever())

    async def _renew_forever(self) -> None:
        engine = create_engine(self.db_url)
        try:
            try:
                await renew(engine, self.owner, self.host, self.lease_seconds, clock=self.clock)
                await purge(engine, clock=self.clock)
                self.renewals += 1
            except Exception as exc:  # noqa: BLE001 - handed to start(), which raises it
                self._error = exc
                return
            finally:
                self._ready.set()
            # this loop has nothing else to do
            while not self.clock.wait(self._stop, self.lease_seconds / 3):
                stalled = self.clock.monotonic() - self._turned
                if stalled >= self.lease_seconds:
                    self.stalls += 1
                    log.error(
                        "the event loop has not turned for %.1f s: not renewing this process's"
                        " lease (its runs will be settled by another process)",
                        stalled,
                    )
                    continue
                try:
                    await renew(
                        engine,
                        self.owner,
                        self.host,
                        self.lease_seconds,
                        turned=self._turned,
                        clock=self.clock,
                    )
                    self.renewals += 1
                except Exception:
                    log.exception("renewing this process's lease failed (retried)")
            with contextlib.suppress(Exception):
                await drop(engine, self.owner)
        finally:
            await engine.dispose()
