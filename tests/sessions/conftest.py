"""Fixtures for sandbox sessions: a real runtime (SQLite, real sandboxes), a funded org, and
the real app over httpx's ASGI transport with a member's key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from ephemeral.api import create_app
from ephemeral.engine.runtime import Runtime
from ephemeral.sandbox.registry import probe_level
from ephemeral.settings import Settings
from tests import runlevel
from tests.api.conftest import Member, new_member
from tests.drivers import unavailable


@pytest.fixture(params=["gvisor", "namespaces"])
async def isolation(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    level = str(request.param)
    why = await probe_level(level, Settings.load(state_dir=tmp_path / "probe"))
    if why is not None:
        unavailable(f"{level}: {why}", level)
    return level


@pytest.fixture
def session_settings(tmp_path: Path) -> Settings:
    return Settings.load(state_dir=tmp_path / "state", use_prefect=False)


@pytest.fixture
async def runtime(session_settings: Settings) -> AsyncIterator[Runtime]:
    async with runlevel.started(session_settings, check=True) as rt:
        yield rt


@pytest.fixture
async def org(runtime: Runtime) -> str:
    made = await runtime.store.orgs.create("acme")
    await runtime.store.orgs.credit(made.id, 1_000_000, note="test")
    return made.id


@pytest.fixture
async def http(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(runtime.settings, runtime)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield client


@pytest.fixture
async def member(runtime: Runtime) -> Member:
    return await new_member(runtime, "acme")
