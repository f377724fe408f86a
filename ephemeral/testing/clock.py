"""A clock that moves only when told (:meth:`FakeClock.advance`), for the :class:`Clock` seam
(``ephemeral.clock``): lease, time-limit and watchdog tests advance it instead of sleeping."""

from __future__ import annotations

import asyncio
import threading
from datetime import datetime, timedelta

from ephemeral.ids import utcnow

# How often a thread blocked in ``wait`` looks at its event: setting a ``threading.Event`` wakes
# nobody but its own waiters, so the fake's condition cannot hear it.
EVENT_POLL_SECONDS = 0.02


class FakeClock:
    def __init__(self, start: float = 1_000.0, wall: datetime | None = None) -> None:
        self._start = self._t = start
        self._wall = wall if wall is not None else utcnow()
        self._moved = threading.Condition()
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def monotonic(self) -> float:
        with self._moved:
            return self._t

    def now(self) -> datetime:
        return self._wall + timedelta(seconds=self.monotonic() - self._start)

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future = asyncio.get_running_loop().create_future()
        with self._moved:
            self._sleepers.append((self._t + seconds, future))
        await future

    def wait(self, event: threading.Event, seconds: float) -> bool:
        with self._moved:
            until = self._t + seconds
            while not event.is_set() and self._t < until:
                self._moved.wait(EVENT_POLL_SECONDS)
        return event.is_set()

    def advance(self, seconds: float) -> None:
        """Move time on by ``seconds``: wake the sleepers now due (each on its own loop, at its
        next turn) and the threads waiting in ``wait``."""
        with self._moved:
            self._t += seconds
            due = [f for at, f in self._sleepers if at <= self._t]
            self._sleepers = [(at, f) for at, f in self._sleepers if at > self._t]
            self._moved.notify_all()
        for future in due:
            future.get_loop().call_soon_threadsafe(_wake, future)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
