"""Admission: the conditional reservation under concurrency, and Idempotency-Key semantics."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
import sqlalchemy as sa

from ephemeral import errors
from ephemeral.ids import new_run_id, utcnow
from ephemeral.store import Org, Store
from ephemeral.store.schema import idempotency, ledger, runs
from tests.store.storehelp import policy

COST = 40_000


async def _admit(store: Store, org: Org, **kw: object):
    args: dict[str, object] = {
        "org_id": org.id,
        "run_id": new_run_id(),
        "model": "replay/x",
        "prompt": "hello",
        "policy": policy(COST),
    }
    args.update(kw)
    return await store.runs.admit(**args)  # type: ignore[arg-type]


async def test_200_concurrent_admissions_never_overdraw(store: Store) -> None:
    fits = 37
    org = await store.orgs.create("race")
    await store.orgs.credit(org.id, fits * COST + COST - 1)  # one micro short of one more run

    started = time.perf_counter()
    outcomes = await asyncio.gather(
        *(_admit(store, org) for _ in range(200)), return_exceptions=True
    )
    elapsed = time.perf_counter() - started

    admitted = [o for o in outcomes if isinstance(o, tuple)]
    refused = [o for o in outcomes if isinstance(o, errors.PaymentRequired)]
    others = [o for o in outcomes if not isinstance(o, tuple | errors.PaymentRequired)]
    assert others == []
    assert len(admitted) == fits
    assert len(refused) == 200 - fits
    assert all(run.status == "queued" and not replayed for run, replayed in admitted)

    after = await store.orgs.get(org.id)
    assert after.reserved_micros == fits * COST
    assert after.balance_micros == fits * COST + COST - 1
    assert after.available_micros == COST - 1
    async with store.engine.connect() as conn:
        n_runs = await conn.scalar(sa.select(sa.func.count()).where(runs.c.org_id == org.id))
        reserve_rows = (
            await conn.execute(
                sa.select(sa.func.count(), sa.func.sum(ledger.c.amount_micros)).where(
                    ledger.c.org_id == org.id, ledger.c.kind == "reserve"
                )
            )
        ).one()
    assert n_runs == fits
    assert tuple(reserve_rows) == (fits, fits * COST)
    print(f"\n200 concurrent admissions on {store.dialect}: {elapsed * 1000:.0f} ms")


async def test_refusal_names_balance_and_need(store: Store) -> None:
    org = await store.orgs.create("poor")
    await store.orgs.credit(org.id, 10_000)
    with pytest.raises(errors.PaymentRequired) as info:
        await _admit(store, org)
    assert info.value.status == 402
    assert "40000" in info.value.detail and "10000" in info.value.detail
    # A refused admission leaves nothing behind.
    assert await store.runs.list(org.id) == ([], None)


async def test_unknown_org_is_not_found(store: Store) -> None:
    with pytest.raises(errors.NotFound):
        await store.runs.admit(
            org_id="org_nope", run_id=new_run_id(), model="m/x", prompt="p", policy=policy()
        )


@pytest.mark.parametrize("bad", [0, -5, True, 1.5, None, "40000"])
async def test_max_cost_must_be_positive_integer(store: Store, org: Org, bad: object) -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        await _admit(store, org, policy={"max_cost_micros": bad})
    assert info.value.errors and info.value.errors[0]["field"] == "max_cost_micros"


async def test_admission_records_queued_event_and_policy_unchanged(store: Store, org: Org) -> None:
    pol = policy(COST, zero_data_retention=False, timeout_seconds=33)
    run, replayed = await _admit(store, org, policy=pol, labels={"suite": "s1"})
    assert not replayed
    assert run.policy == pol and list(run.policy) == list(pol)
    assert run.labels == {"suite": "s1"}
    assert run.reserved_micros == COST and run.charged_micros == 0
    events = await store.events.list(run.id)
    queued = (1, "run.queued", {"reserved_micros": COST})
    assert [(e.seq, e.type, e.data) for e in events] == [queued]
    # The row admission returns (from its INSERT) is the row as stored, field for field.
    assert run == await store.runs.get(run.id)


async def test_same_key_same_body_replays_reserving_once(store: Store, org: Org) -> None:
    first, replayed1 = await _admit(store, org, idempotency_key="k-1", body_hash="h1")
    second, replayed2 = await _admit(store, org, idempotency_key="k-1", body_hash="h1")
    assert (replayed1, replayed2) == (False, True)
    assert second.id == first.id
    assert (await store.orgs.get(org.id)).reserved_micros == COST


async def test_same_key_other_body_is_422(store: Store, org: Org) -> None:
    await _admit(store, org, idempotency_key="k-1", body_hash="h1")
    with pytest.raises(errors.InvalidRequest) as info:
        await _admit(store, org, idempotency_key="k-1", body_hash="h2")
    assert info.value.status == 422
    assert info.value.errors and info.value.errors[0]["field"] == "Idempotency-Key"
    assert (await store.orgs.get(org.id)).reserved_micros == COST


async def test_keys_are_scoped_per_org(store: Store, org: Org) -> None:
    other = await store.orgs.ensure("other", initial_credit_micros=1_000_000)
    a, _ = await _admit(store, org, idempotency_key="shared", body_hash="h1")
    b, replayed = await _admit(store, other, idempotency_key="shared", body_hash="h2")
    assert not replayed and a.id != b.id


async def test_key_still_being_admitted_is_409(store: Store, org: Org) -> None:
    # Another admission holds the claim (committed as 'admitting', not yet 'done').
    async with store.engine.begin() as conn:
        await conn.execute(
            sa.insert(idempotency).values(
                org_id=org.id,
                key="busy",
                body_hash="h1",
                run_id=new_run_id(),
                state="admitting",
                created_at=utcnow(),
            )
        )
    with pytest.raises(errors.Conflict) as info:
        await _admit(store, org, idempotency_key="busy", body_hash="h1")
    assert info.value.status == 409
    assert (await store.orgs.get(org.id)).reserved_micros == 0


async def test_concurrent_duplicates_hold_once(store: Store, org: Org) -> None:
    outcomes = await asyncio.gather(
        *(_admit(store, org, idempotency_key="dup", body_hash="h") for _ in range(20)),
        return_exceptions=True,
    )
    fresh = [o for o in outcomes if isinstance(o, tuple) and not o[1]]
    replays = [o for o in outcomes if isinstance(o, tuple) and o[1]]
    conflicts = [o for o in outcomes if isinstance(o, errors.Conflict)]
    assert len(fresh) == 1
    assert len(replays) + len(conflicts) == 19
    assert {run.id for run, _ in replays} <= {fresh[0][0].id}
    assert (await store.orgs.get(org.id)).reserved_micros == COST


async def test_refused_admission_releases_the_key(store: Store) -> None:
    org = await store.orgs.create("later")
    with pytest.raises(errors.PaymentRequired):
        await _admit(store, org, idempotency_key="retry-me", body_hash="h")
    await store.orgs.credit(org.id, COST)
    run, replayed = await _admit(store, org, idempotency_key="retry-me", body_hash="h")
    assert not replayed and run.status == "queued"


@pytest.mark.parametrize("key", ["", "x" * 256, "tab\there", "é"])
async def test_bad_idempotency_key_names_the_field(store: Store, org: Org, key: str) -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        await _admit(store, org, idempotency_key=key, body_hash="h")
    assert info.value.errors and info.value.errors[0]["field"] == "Idempotency-Key"


async def test_purge_keeps_keys_for_a_day(store: Store, org: Org) -> None:
    await _admit(store, org, idempotency_key="fresh", body_hash="h")
    assert await store.retention.purge_idempotency() == 0
    with pytest.raises(errors.InvalidRequest):
        await store.retention.purge_idempotency(older_than=timedelta(hours=1))


async def test_reused_run_id_is_a_conflict_and_holds_nothing(store: Store, org: Org) -> None:
    run, _ = await _admit(store, org)
    with pytest.raises(errors.Conflict):
        await _admit(store, org, run_id=run.id)
    assert (await store.orgs.get(org.id)).reserved_micros == COST
