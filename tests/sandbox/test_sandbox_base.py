"""The lifecycle every sandbox shares (adopt, expiry, destroy-once, ``async with``) and the warm
pool's use of it, on the in-memory fake: no host sandbox needed. The real drivers run the same
base class in test_conformance.py."""

from __future__ import annotations

import asyncio

import pytest

from ephemeral import errors
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.sandbox.pool import WarmPool
from ephemeral.testing.sandbox import FakeDriver, FakeSandbox


class CountingSandbox(FakeSandbox):
    def __init__(self, limits: Limits) -> None:
        super().__init__("test", limits, {})
        self.teardowns = 0

    async def _teardown(self) -> None:
        await asyncio.sleep(0.01)  # racing callers overlap here
        self.teardowns += 1
        await super()._teardown()


async def test_every_driver_sandbox_is_a_sandbox() -> None:
    sbx = await FakeDriver().create(owner="test", limits=Limits())
    assert isinstance(sbx, Sandbox)
    await sbx.destroy()


async def test_racing_destroys_tear_down_once() -> None:
    sbx = CountingSandbox(Limits())
    await asyncio.gather(*(sbx.destroy() for _ in range(5)))
    await sbx.destroy()
    assert sbx.teardowns == 1 and not sbx.alive


async def test_lifetime_expires_and_adopt_restarts_it() -> None:
    sbx = await FakeDriver().create(owner="pool", limits=Limits(lifetime_seconds=1.0))
    await asyncio.sleep(0.7)
    await sbx.adopt("run_a")  # the clock starts again for the real owner
    await asyncio.sleep(0.5)  # past the first clock's end, 0.5 s before the second's
    assert sbx.alive and isinstance(sbx, FakeSandbox) and sbx.owner == "run_a"
    async with asyncio.timeout(10):
        while sbx.alive:
            await asyncio.sleep(0.05)
    with pytest.raises(errors.SandboxError):
        await sbx.exec("true")


async def test_async_with_destroys_on_exit_even_on_error() -> None:
    driver = FakeDriver()
    with pytest.raises(ValueError):
        async with await driver.create(owner="test", limits=Limits()) as sbx:
            assert (await sbx.exec("echo hi")).stdout == "hi\n"
            raise ValueError("boom")
    assert driver.sandboxes[0].destroyed


async def test_pool_adopts_what_it_hands_out_for_its_owner_and_skips_the_dead() -> None:
    driver = FakeDriver()
    pool = WarmPool(driver, size=2, limits=Limits())
    await pool.start()
    try:
        await pool.wait_ready(timeout=5)
        first = driver.sandboxes[0]
        await first.destroy()  # died while idle
        got = await pool.acquire("run_b")
        assert got is not first and got.alive
        assert isinstance(got, FakeSandbox) and got.owner == "run_b"
    finally:
        await pool.close()
    assert all(s.destroyed for s in driver.sandboxes if s is not got)
    await got.destroy()
