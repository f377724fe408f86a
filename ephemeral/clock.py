"""Time, read through one seam: the process lease, a session's time limit and compute deadline,
and its watchdog ask a :class:`Clock` instead of ``time``/``asyncio`` directly, so their tests
move a fake clock (``ephemeral.testing.clock``) instead of sleeping.

``monotonic`` measures intervals (deadlines, a lease's stall); ``now`` is the wall clock that
rows and leases are stamped with (aware UTC); ``sleep`` waits on this event loop; ``wait`` waits
from a thread for an event or until ``seconds`` have passed (the process lease's own thread).
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import datetime
from typing import Protocol

from ephemeral.ids import utcnow


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def now(self) -> datetime: ...

    async def sleep(self, seconds: float) -> None: ...

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """From any thread: True once ``event`` is set, False when ``seconds`` passed first."""
        ...


class SystemClock:
    """The real clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return utcnow()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(seconds)


SYSTEM: Clock = SystemClock()
