"""Orgs and member keys: hashed at rest, shown once, revocable."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.store import Org, Store


async def test_key_authenticates_its_member(store: Store, org: Org) -> None:
    key, plaintext = await store.keys.create(org.id, "ada@example.com")
    assert plaintext.startswith("eph_") and len(plaintext) > 40
    assert key.prefix == plaintext[:12] and key.revoked_at is None
    principal = await store.keys.authenticate(plaintext)
    assert (principal.org_id, principal.member, principal.key_id) == (
        org.id,
        "ada@example.com",
        key.id,
    )


async def test_plaintext_is_not_in_the_database_file(sqlite_store: Store, sqlite_url: str) -> None:
    org = await sqlite_store.orgs.create("hashed")
    plaintexts = [(await sqlite_store.keys.create(org.id, f"m{i}@x"))[1] for i in range(5)]
    await sqlite_store.close()
    db = Path(sqlite_url.split("///", 1)[1])
    blob = b"".join(p.read_bytes() for p in db.parent.iterdir() if p.name.startswith(db.name))
    for plaintext in plaintexts:
        assert plaintext.encode() not in blob
        assert plaintext[12:].encode() not in blob
        assert hashlib.sha256(plaintext.encode()).hexdigest().encode() in blob


@pytest.mark.parametrize("bad", ["", "eph_", "sk-abc", "eph_" + "x" * 40, "x" * 5000, "eph_é" * 9])
async def test_bad_keys_are_unauthorized(store: Store, org: Org, bad: str) -> None:
    await store.keys.create(org.id, "a@x")
    with pytest.raises(errors.Unauthorized):
        await store.keys.authenticate(bad)


async def test_tampered_key_is_unauthorized(store: Store, org: Org) -> None:
    _, plaintext = await store.keys.create(org.id, "a@x")
    flipped = plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")
    with pytest.raises(errors.Unauthorized):
        await store.keys.authenticate(flipped)


async def test_revoked_key_is_unauthorized(store: Store, org: Org) -> None:
    key, plaintext = await store.keys.create(org.id, "a@x")
    _, other = await store.keys.create(org.id, "b@x")
    await store.keys.revoke(key.id)
    await store.keys.revoke(key.id)  # idempotent
    with pytest.raises(errors.Unauthorized) as info:
        await store.keys.authenticate(plaintext)
    assert info.value.status == 401
    assert (await store.keys.authenticate(other)).member == "b@x"
    listed = await store.keys.list(org.id)
    assert [(k.member, k.revoked_at is not None) for k in listed] == [("a@x", True), ("b@x", False)]
    with pytest.raises(errors.NotFound):
        await store.keys.revoke("key_nope")


async def test_orgs_create_get_ensure(store: Store) -> None:
    made = await store.orgs.create("globex")
    assert (made.balance_micros, made.reserved_micros) == (0, 0)
    assert await store.orgs.get("globex") == made
    assert await store.orgs.get(made.id) == made
    with pytest.raises(errors.Conflict):
        await store.orgs.create("globex")
    with pytest.raises(errors.NotFound):
        await store.orgs.get("initech")
    with pytest.raises(errors.InvalidRequest) as info:
        await store.orgs.create("bad name!")
    assert info.value.errors and info.value.errors[0]["field"] == "name"
    # orgs.ensure credits only when it creates, also when racing with itself.
    ensured = await asyncio.gather(
        *(store.orgs.ensure("local", initial_credit_micros=5_000_000) for _ in range(5))
    )
    assert {o.id for o in ensured} == {ensured[0].id}
    assert (await store.orgs.get("local")).balance_micros == 5_000_000
    assert (await store.orgs.ensure("local", initial_credit_micros=7)).balance_micros == 5_000_000


async def test_key_for_unknown_org_and_bad_member(store: Store, org: Org) -> None:
    with pytest.raises(errors.NotFound):
        await store.keys.create("org_nope", "a@x")
    with pytest.raises(errors.InvalidRequest) as info:
        await store.keys.create(org.id, "")
    assert info.value.errors and info.value.errors[0]["field"] == "member"


async def test_open_refuses_bad_urls_with_the_field(tmp_path: Path) -> None:
    for url in (
        "sqlite+aiosqlite://",
        "sqlite:///x.db",
        "mysql+aiomysql://127.0.0.1/db",
        "postgresql://127.0.0.1/db",
    ):
        with pytest.raises(errors.InvalidRequest) as info:
            await Store.open(url)
        assert info.value.errors and info.value.errors[0]["field"] == "database_url"


async def test_open_unreachable_postgres_is_a_clear_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(errors.EphemeralError) as info:
        await Store.open(f"postgresql+asyncpg://u:secret@127.0.0.1:{port}/db")
    assert "cannot open the store" in info.value.detail and "secret" not in info.value.detail
