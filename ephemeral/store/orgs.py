"""Orgs (with their credit) and their members' API keys."""

from __future__ import annotations

import re

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from ephemeral import errors
from ephemeral.ids import new_id, utcnow
from ephemeral.store import keys, ledger, rows
from ephemeral.store.db import Repository
from ephemeral.store.models import ApiKey, Org, Principal
from ephemeral.store.schema import api_keys, orgs

ORG_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class Orgs(Repository):
    async def create(self, name: str) -> Org:
        async with self._db.write() as conn:
            org = await _insert(conn, name)
        if org is None:
            raise errors.Conflict(f"org {name!r} already exists")
        return org

    async def get(self, name_or_id: str) -> Org:
        async with self._db.read() as conn:
            return await rows.org(conn, name_or_id)

    async def ensure(self, name: str, *, initial_credit_micros: int = 0) -> Org:
        """Get ``name``, creating it with ``initial_credit_micros`` if it does not exist yet."""
        ledger.check_micros("initial_credit_micros", initial_credit_micros)
        async with self._db.write() as conn:
            made = await _insert(conn, name)
            if made is None:
                return await rows.org(conn, name)
            if initial_credit_micros:
                await ledger.credit(
                    conn, org_id=made.id, micros=initial_credit_micros, note="initial credit"
                )
            return await rows.org(conn, made.id)

    async def credit(self, org_id: str, micros: int, note: str = "") -> Org:
        async with self._db.write() as conn:
            org = await rows.org(conn, org_id)
            await ledger.credit(conn, org_id=org.id, micros=micros, note=note)
            return await rows.org(conn, org.id)


async def _insert(conn: AsyncConnection, name: str) -> Org | None:
    if not isinstance(name, str) or not ORG_NAME_RE.match(name):
        raise errors.InvalidRequest.field(
            "name", "must be 1-100 characters of letters, digits, '.', '_' or '-'"
        )
    made = await conn.execute(
        ledger.insert(conn, orgs)
        .values(
            id=new_id("org"),
            name=name,
            balance_micros=0,
            reserved_micros=0,
            created_at=utcnow(),
        )
        .on_conflict_do_nothing()
        .returning(*orgs.c)
    )
    row = made.first()
    return None if row is None else Org.model_validate(row._mapping)


class Keys(Repository):
    async def create(self, org_id: str, member: str) -> tuple[ApiKey, str]:
        if not isinstance(member, str) or not 0 < len(member) <= 320 or not member.isprintable():
            raise errors.InvalidRequest.field("member", "must be 1-320 printable characters")
        plaintext = keys.generate()
        async with self._db.write() as conn:
            org = await rows.org(conn, org_id)
            row = (
                await conn.execute(
                    sa.insert(api_keys)
                    .values(
                        id=new_id("key"),
                        org_id=org.id,
                        member=member,
                        prefix=keys.prefix(plaintext),
                        hash=keys.digest(plaintext),
                        created_at=utcnow(),
                    )
                    .returning(*api_keys.c)
                )
            ).one()
        return ApiKey.model_validate(row._mapping), plaintext

    async def revoke(self, key_id: str) -> None:
        async with self._db.write() as conn:
            found = await conn.scalar(sa.select(api_keys.c.id).where(api_keys.c.id == key_id))
            if found is None:
                raise errors.NotFound(f"key {key_id!r} not found")
            await conn.execute(
                sa.update(api_keys)
                .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
                .values(revoked_at=utcnow())
            )

    async def list(self, org_id: str) -> list[ApiKey]:
        async with self._db.read() as conn:
            org = await rows.org(conn, org_id)
            found = await conn.execute(
                sa.select(api_keys)
                .where(api_keys.c.org_id == org.id)
                .order_by(api_keys.c.created_at, api_keys.c.id)
            )
            return [ApiKey.model_validate(r._mapping) for r in found]

    async def authenticate(self, plaintext: str) -> Principal:
        if not keys.well_formed(plaintext):
            raise errors.Unauthorized("missing or malformed API key")
        async with self._db.read() as conn:
            candidates = (
                await conn.execute(
                    sa.select(api_keys).where(api_keys.c.prefix == keys.prefix(plaintext))
                )
            ).all()
        for row in candidates:
            if keys.matches(row.hash, plaintext):
                if row.revoked_at is not None:
                    raise errors.Unauthorized("this API key has been revoked")
                return Principal(org_id=row.org_id, member=row.member, key_id=row.id)
        raise errors.Unauthorized("unknown API key")
