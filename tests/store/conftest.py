"""Fixtures for the store tests: one store per test on a real SQLite file or PostgreSQL."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from ephemeral.store import Org, Store


def pytest_configure(config: pytest.Config) -> None:
    # The top-level conftest may already load the plugin; loading it twice would start two
    # clusters.
    if not config.pluginmanager.has_plugin("tests.fixtures_pg"):
        config.pluginmanager.import_plugin("tests.fixtures_pg")


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'state' / 'ephemeral.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    if request.param == "sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    return str(request.getfixturevalue("postgres_db_url"))


@contextlib.asynccontextmanager
async def open_store(url: str) -> AsyncIterator[Store]:
    store = await Store.open(url)
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[Store]:
    async with open_store(db_url) as s:
        yield s


@pytest.fixture
async def sqlite_store(sqlite_url: str) -> AsyncIterator[Store]:
    async with open_store(sqlite_url) as s:
        yield s


@pytest.fixture
async def org(store: Store) -> Org:
    return await store.orgs.ensure("acme", initial_credit_micros=1_000_000)
