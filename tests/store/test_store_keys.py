"""Orgs and member keys: hashed at rest, shown once, revocable."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.store import Org, Store


async def test_key_authenticates_its_member(store: Store, org: Org) -> None:
    key, plaintext = await store.create_key(org.id, "ada@example.com")
    assert plaintext.startswith("eph_") and len(plaintext) > 40
    assert key.prefix == plaintext[:12] and key.revoked_at is None
    principal = await store.authenticate(plaintext)
    assert (principal.org_id, principal.member, principal.key_id) == (
        org.id,
        "ada@example.com",
        key.id,
    )


async def test_plaintext_is_not_in_the_database_file(sqlite_store: Store, sqlite_url: str) -> None:
    org = await sqlite_store.create_org("hashed")
    plaintexts = [(await sqlite_store.create_key(org.id, f"m{i}@x"))[1] for i in range(5)]
    await sqlite_store.close()
    db = Path(sqlite_url.split("///", 1)[1])
    blob = b"".join(p.read_bytes() for p in db.parent.iterdir() if p.name.startswith(db.name))
    for plaintext in plaintexts:
        assert plaintext.encode() not in blob
        assert plaintext[12:].encode() not in blob
        assert hashlib.sha256(plaintext.encode()).hexdigest().encode() in blob


@pytest.mark.parametrize("bad", ["", "eph_", "sk-abc", "eph_" + "x" * 40, "x" * 5000, "eph_é" * 9])
async def test_bad_keys_are_unauthorized(store: Store, org: Org, bad: str) -> None:
    await store.create_key(org.id, "a@x")
    with pytest.raises(errors.Unauthorized):
        await store.authenticate(bad)


async def test_tampered_key_is_unauthorized(store: Store, org: Org) -> None:
    _, plaintext = await store.create_key(org.id, "a@x")
    flipped = plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")
    with pytest.raises(errors.Unauthorized):
        await store.authenticate(flipped)


async def test_revoked_key_is_unauthorized(store: Store, org: Org) -> None:
    key, plaintext = await store.create_key(org.id, "a@x")
    _, other = await store.create_key(org.id, "b@x")
    await store.revoke_key(key.id)
    await store.revoke_key(key.id)  # idempotent
    with pytest.raises(errors.Unauthorized) as info:
        await store.authenticate(plaintext)
    assert info.value.status == 401
    assert (await store.authenticate(other)).member == "b@x"
    listed = await store.list_keys(org.id)
    assert [(k.member, k.revoked_at is not None) for k in listed] == [("a@x", True), ("b@x", False)]
    with pytest.raises(errors.NotFound):
        await store.revoke_key("key_nope")


async def test_orgs_create_get_ensure(store: Store) -> None:
    made = await store.create_org("globex")
    assert (made.balance_micros, made.reserved_micros) == (0, 0)
    assert await store.get_org("globex") == made
    assert await store.get_org(made.id) == made
    with pytest.raises(errors.Conflict):
        await store.create_org("globex")
    with pytest.raises(errors.NotFound):
        await store.get_org("initech")
    with pytest.raises(errors.InvalidRequest) as info:
        await store.create_org("bad name!")
    assert info.value.errors and info.value.errors[0]["field"] == "name"
    # ensure_org credits only when it creates, also when racing with itself.
    ensured = await asyncio.gather(
        *(store.ensure_org("local", initial_credit_micros=5_000_000) for _ in range(5))
    )
    assert {o.id for o in ensured} == {ensured[0].id}
    assert (await store.get_org("local")).balance_micros == 5_000_000
    assert (await store.ensure_org("local", initial_credit_micros=7)).balance_micros == 5_000_000


async def test_key_for_unknown_org_and_bad_member(store: Store, org: Org) -> None:
    with pytest.raises(errors.NotFound):
        await store.create_key("org_nope", "a@x")
    with pytest.raises(errors.InvalidRequest) as info:
        await store.create_key(org.id, "")
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
