"""A warm sandbox handed to a longer run or session keeps it for the owner's whole lifetime
(before, ``adopt``, then spelled ``claim``, restarted the pool's own lifetime: a 15-minute
session lost its sandbox at the pool's 130 s)."""

from __future__ import annotations

import asyncio

from ephemeral.sandbox.base import Limits
from ephemeral.sandbox.pool import WarmPool
from ephemeral.testing.sandbox import FakeDriver


async def test_adopt_takes_the_owners_lifetime() -> None:
    pool = WarmPool(FakeDriver(), 2, Limits(lifetime_seconds=0.3))
    await pool.start()
    try:
        await pool.wait_ready(10)
        long = await pool.acquire("long", Limits(lifetime_seconds=30))
        short = await pool.acquire("short")
        async with asyncio.timeout(10):  # the pool's 0.3 s ends the short one
            while short.alive:
                await asyncio.sleep(0.05)
        assert long.alive
        await long.destroy()
    finally:
        await pool.close()
