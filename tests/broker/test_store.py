"""The connections table on both backends: add, replace, list, missing, remove, per org."""

from __future__ import annotations

from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.store import Store


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'e.db'}"
    return str(request.getfixturevalue("postgres_db_url"))


async def test_connections_per_org(db_url: str) -> None:
    store = await Store.open(db_url)
    try:
        a = await store.orgs.create("a")
        b = await store.orgs.create("b")
        made = await store.connections.add(
            a.id, "svc", base_url="https://x.example", header_names=["X-K"], sealed_headers="T1"
        )
        assert (made.name, made.header_names, made.sealed_headers) == ("svc", ["X-K"], "T1")
        with pytest.raises(errors.Conflict):
            await store.connections.add(
                a.id, "svc", base_url="https://y.example", header_names=[], sealed_headers="T2"
            )
        await store.connections.add(
            a.id,
            "svc",
            base_url="https://y.example",
            header_names=[],
            sealed_headers="T2",
            replace=True,
        )
        assert (await store.connections.get(a.id, "svc")).base_url == "https://y.example"
        assert await store.connections.missing(a.id, ["svc", "other"]) == ["other"]
        assert await store.connections.missing(b.id, ["svc"]) == ["svc"]  # not b's
        with pytest.raises(errors.NotFound):
            await store.connections.get(b.id, "svc")
        assert [c.name for c in await store.connections.list("a")] == ["svc"]
        assert await store.connections.list(b.id) == []
        with pytest.raises(errors.InvalidRequest) as info:
            await store.connections.add(
                a.id, "Bad Name", base_url="https://x", header_names=[], sealed_headers=""
            )
        assert info.value.errors and info.value.errors[0]["field"] == "name"
        await store.connections.remove(a.id, "svc")
        with pytest.raises(errors.NotFound):
            await store.connections.remove(a.id, "svc")
        with pytest.raises(errors.NotFound):
            await store.connections.list("nobody")
    finally:
        await store.close()
