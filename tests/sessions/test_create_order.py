"""Creates of one kind of sandbox take turns, in the order they came, as many at once as
sandboxes may boot; another kind is not held back by them. A real store and sessions; the
sandboxes are the in-tree fake behind a source whose boots wait for the test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from ephemeral.money.pricing import PriceBook
from ephemeral.policy import Policy
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.sandbox.pool import boots_at_once
from ephemeral.sandbox.source import SandboxSource
from ephemeral.sessions.manager import Sessions
from ephemeral.sessions.requests import SessionRequest
from ephemeral.settings import Settings
from ephemeral.store import Store
from ephemeral.testing.sandbox import FakeDriver


class HeldBoots(SandboxSource):
    """Sandboxes of the default image boot only once ``release`` is set."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.release = asyncio.Event()
        self.booting: list[str] = []  # owners, in the order their boots began

    async def require_isolation(self, requested: str, *, disk_mib: int | None = None) -> str:
        return "fake"

    async def ensure_pool(self) -> None:
        return None

    def built_image(self, name: str) -> None:
        return None

    async def require_image(self, policy: Policy) -> None:
        return None  # its sandboxes are fakes: any image name boots (admission checks none)

    async def acquire(
        self, policy: Policy, owner: str, limits: Limits, image_hash: str | None = None
    ) -> Sandbox:
        self.booting.append(owner)
        if policy.run_image is None:
            await self.release.wait()
        return await FakeDriver().create(owner=owner, limits=limits)


@pytest.fixture
async def sessions(tmp_path: Path) -> AsyncIterator[Sessions]:
    settings = Settings.load(state_dir=tmp_path / "state", use_prefect=False)
    store = await Store.open(settings.db_url)
    made = Sessions(settings, store, PriceBook.load(settings), HeldBoots(settings), "test-owner")
    try:
        yield made
    finally:
        await made.close()
        await store.close()


async def _settle(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def test_creates_of_one_kind_take_turns_in_order(sessions: Sessions) -> None:
    org = await sessions.store.orgs.ensure("turns", initial_credit_micros=10_000_000)
    source = sessions.sandboxes
    assert isinstance(source, HeldBoots)
    slots = boots_at_once()
    request = SessionRequest(max_cost_micros=10_000, timeout_seconds=60)
    creates = []
    for i in range(slots + 3):
        creates.append(asyncio.create_task(sessions.create(org.id, request, labels={"n": i})))
        await asyncio.sleep(0)
    await _settle(lambda: len(source.booting) == slots, f"{slots} boots began")
    await asyncio.sleep(0.2)
    # The rest wait their turn before admission: nothing reserved or recorded for them yet.
    admitted = await sessions.store.runs.open()
    assert sorted(r.labels["n"] for r in admitted) == list(range(slots))
    assert len(source.booting) == slots

    # Another image is a kind of its own: it starts at once.
    other, _ = await asyncio.wait_for(
        sessions.create(org.id, SessionRequest(max_cost_micros=10_000, image="other")), 10
    )
    assert other.status == "running"

    source.release.set()
    made = [row for row, _ in await asyncio.gather(*creates)]
    assert [r.status for r in made] == ["running"] * (slots + 3)
    ids = [r.id for r in made]
    booted = [owner for owner in source.booting if owner != other.id]
    # The first to ask booted first; the ones that waited booted after them (each group's
    # own admissions and boots run concurrently, so within a group any order).
    assert set(booted[:slots]) == set(ids[:slots])
    assert set(booted[slots:]) == set(ids[slots:]) and len(booted) == len(ids)
    for row in [*made, other]:
        ended = await sessions.end(row.id)
        assert ended.status == "succeeded" and ended.settled
