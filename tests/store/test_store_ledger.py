"""Charges inside a reservation and settlement: the money invariants of DESIGN §3, §6."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ephemeral import errors
from ephemeral.ids import new_run_id
from ephemeral.store import Org, RunRow, Store
from ephemeral.store.schema import ledger
from tests.store.storehelp import policy

KINDS = ("model", "web", "compute")


async def _run(store: Store, org: Org, reserved: int = 10_000) -> RunRow:
    run, _ = await store.runs.admit(
        org_id=org.id, run_id=new_run_id(), model="replay/x", prompt="p", policy=policy(reserved)
    )
    return run


async def test_charges_accumulate_and_settle_refunds_the_rest(store: Store, org: Org) -> None:
    run = await _run(store, org)
    assert await store.money.charge(run.id, "model", 330, "m1") == 330
    assert await store.money.charge(run.id, "compute", 3200, "c1") == 3530
    assert await store.money.charged(run.id) == {
        "model_micros": 330,
        "web_micros": 0,
        "compute_micros": 3200,
    }
    settled = await store.money.settle(run.id)
    assert (settled.reserved_micros, settled.charged_micros, settled.refunded_micros) == (
        10_000,
        3530,
        6470,
    )
    assert settled.breakdown == {"model_micros": 330, "web_micros": 0, "compute_micros": 3200}
    after = await store.orgs.get(org.id)
    assert (after.balance_micros, after.reserved_micros) == (1_000_000 - 3530, 0)
    stored = await store.runs.get(run.id)
    assert stored.settled and stored.refunded_micros == 6470
    assert stored.breakdown == settled.breakdown


async def test_settle_is_idempotent(store: Store, org: Org) -> None:
    run = await _run(store, org)
    await store.money.charge(run.id, "web", 100, "w1")
    first = await store.money.settle(run.id)
    again = await asyncio.gather(*(store.money.settle(run.id) for _ in range(5)))
    assert all(s == first for s in again)
    after = await store.orgs.get(org.id)
    assert (after.balance_micros, after.reserved_micros) == (1_000_000 - 100, 0)


async def test_charge_is_idempotent_on_key(store: Store, org: Org) -> None:
    run = await _run(store, org)
    totals = await asyncio.gather(
        *(store.money.charge(run.id, "model", 500, "same") for _ in range(10))
    )
    assert set(totals) == {500}
    with pytest.raises(errors.Conflict):
        await store.money.charge(run.id, "model", 501, "same")


async def test_charge_beyond_reservation_is_refused_whole(store: Store, org: Org) -> None:
    run = await _run(store, org, reserved=1_000)
    await store.money.charge(run.id, "model", 900, "a")
    with pytest.raises(errors.BudgetExhausted):
        await store.money.charge(run.id, "compute", 101, "b")
    assert await store.money.charge(run.id, "compute", 100, "c") == 1_000
    settled = await store.money.settle(run.id)
    assert (settled.charged_micros, settled.refunded_micros) == (1_000, 0)


async def test_concurrent_charges_never_pass_the_reservation(store: Store, org: Org) -> None:
    run = await _run(store, org, reserved=1_000)
    outcomes = await asyncio.gather(
        *(store.money.charge(run.id, KINDS[i % 3], 7, f"k{i}") for i in range(200)),
        return_exceptions=True,
    )
    ok = [o for o in outcomes if isinstance(o, int)]
    assert all(isinstance(o, int | errors.BudgetExhausted) for o in outcomes)
    assert len(ok) == 1_000 // 7
    assert sum((await store.money.charged(run.id)).values()) == 7 * len(ok)
    settled = await store.money.settle(run.id)
    assert settled.charged_micros + settled.refunded_micros == settled.reserved_micros


async def test_a_batch_adds_its_fresh_charges_once(store: Store, org: Org) -> None:
    run = await _run(store, org)
    await store.money.charge(run.id, "web", 100, "w:1")
    # w:1 is already in the ledger and w:3 is in the batch twice: each counts once
    batch = [("w:1", 100), ("w:2", 100), ("w:3", 250), ("w:3", 250)]
    assert await store.money.charge_batch(run.id, "web", batch) == 450
    assert (
        await store.money.charge_batch(run.id, "web", batch) == 450
    )  # a retried batch: nothing new
    assert await store.money.charged(run.id) == {
        "model_micros": 0,
        "web_micros": 450,
        "compute_micros": 0,
    }
    async with store.engine.connect() as conn:
        keys = (
            await conn.execute(
                sa.select(ledger.c.idempotency_key, ledger.c.amount_micros).where(
                    ledger.c.run_id == run.id, ledger.c.kind == "web"
                )
            )
        ).all()
    assert sorted(keys) == [("w:1", 100), ("w:2", 100), ("w:3", 250)]


async def test_a_batch_is_all_or_none(store: Store, org: Org) -> None:
    run = await _run(store, org, reserved=1_000)
    await store.money.charge(run.id, "model", 700, "m")
    with pytest.raises(errors.BudgetExhausted):  # 3 x 100 fits, the fourth does not
        await store.money.charge_batch(run.id, "web", [(f"w:{i}", 100) for i in range(4)])
    with pytest.raises(errors.Conflict):  # a key used before for another amount
        await store.money.charge_batch(run.id, "web", [("w:new", 10), ("m", 699)])
    with pytest.raises(errors.Conflict):  # the same key twice for two amounts
        await store.money.charge_batch(run.id, "web", [("w:x", 10), ("w:x", 11)])
    assert await store.money.charged(run.id) == {
        "model_micros": 700,
        "web_micros": 0,
        "compute_micros": 0,
    }
    assert (
        await store.money.charge_batch(run.id, "web", [(f"w:{i}", 100) for i in range(3)]) == 1_000
    )
    settled = await store.money.settle(run.id)
    assert (settled.charged_micros, settled.refunded_micros) == (1_000, 0)
    with pytest.raises(errors.Conflict):  # settled: no batch either
        await store.money.charge_batch(run.id, "web", [("w:late", 1)])


async def test_no_charge_after_settle(store: Store, org: Org) -> None:
    run = await _run(store, org)
    await store.money.settle(run.id)
    with pytest.raises(errors.Conflict):
        await store.money.charge(run.id, "compute", 1, "late")


@pytest.mark.parametrize(
    ("kind", "micros", "field"),
    [("gpu", 1, "kind"), ("model", -1, "micros"), ("model", 1.5, "micros")],
)
async def test_bad_charge_names_the_field(
    store: Store, org: Org, kind: str, micros: object, field: str
) -> None:
    run = await _run(store, org)
    with pytest.raises(errors.InvalidRequest) as info:
        await store.money.charge(run.id, kind, micros, "k")  # type: ignore[arg-type]
    assert info.value.errors and info.value.errors[0]["field"] == field


async def test_unknown_run(store: Store) -> None:
    for call in (
        store.money.charge("run_" + "0" * 32, "model", 1, "k"),
        store.money.settle("run_" + "0" * 32),
        store.money.charged("run_" + "0" * 32),
    ):
        with pytest.raises(errors.NotFound):
            await call


async def test_credit_and_debit_keep_reservations_covered(store: Store, org: Org) -> None:
    await _run(store, org, reserved=600_000)
    with pytest.raises(errors.InvalidRequest):
        await store.orgs.credit(org.id, -500_000)
    after = await store.orgs.credit(org.id, -400_000, "correction")
    assert (after.balance_micros, after.reserved_micros, after.available_micros) == (
        600_000,
        600_000,
        0,
    )
    with pytest.raises(errors.InvalidRequest):
        await store.orgs.credit(org.id, 0)
    async with store.engine.connect() as conn:
        notes = (
            await conn.execute(
                sa.select(ledger.c.amount_micros, ledger.c.note)
                .where(ledger.c.org_id == org.id, ledger.c.kind == "credit")
                .order_by(ledger.c.id)
            )
        ).all()
    assert [tuple(n) for n in notes] == [(1_000_000, "initial credit"), (-400_000, "correction")]


async def test_mixed_concurrent_lifecycle_keeps_the_books(store: Store) -> None:
    org = await store.orgs.ensure("busy", initial_credit_micros=500_000)

    async def lifecycle(i: int) -> int:
        try:
            run = await _run(store, org, reserved=20_000)
        except errors.PaymentRequired:
            return 0
        for step in range(5):
            try:
                await store.money.charge(
                    run.id, KINDS[step % 3], 1_000 * (i % 7), f"{run.id}:{step}"
                )
            except errors.BudgetExhausted:
                break
        return (await store.money.settle(run.id)).charged_micros

    charged = await asyncio.gather(*(lifecycle(i) for i in range(60)))
    after = await store.orgs.get(org.id)
    assert after.reserved_micros == 0
    assert after.balance_micros == 500_000 - sum(charged)


charge_ops = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 4_000), st.booleans()), max_size=25
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reserved=st.integers(1, 20_000), ops=charge_ops)
def test_any_charge_sequence_settles_consistently(
    tmp_path_factory: pytest.TempPathFactory, reserved: int, ops: list
) -> None:
    db: Path = tmp_path_factory.mktemp("prop") / "e.db"
    asyncio.run(_property(f"sqlite+aiosqlite:///{db}", reserved, ops))


async def _property(url: str, reserved: int, ops: list[tuple[str, int, bool]]) -> None:
    store = await Store.open(url)
    try:
        org = await store.orgs.ensure("p", initial_credit_micros=50_000)
        run = await _run(store, org, reserved=reserved)
        model_total, per_kind = 0, dict.fromkeys(KINDS, 0)
        done: list[tuple[str, str, int]] = []
        for i, (kind, micros, retry_earlier) in enumerate(ops):
            if retry_earlier and done:
                key, k, m = done[i % len(done)]
                assert await store.money.charge(run.id, k, m, key) == model_total
                continue
            key = f"op{i}"
            if model_total + micros <= reserved:
                model_total += micros
                per_kind[kind] += micros
                assert await store.money.charge(run.id, kind, micros, key) == model_total
                done.append((key, kind, micros))
            else:
                with pytest.raises(errors.BudgetExhausted):
                    await store.money.charge(run.id, kind, micros, key)
        settled = await store.money.settle(run.id)
        assert settled.charged_micros == model_total <= reserved
        assert settled.charged_micros + settled.refunded_micros == settled.reserved_micros
        assert settled.breakdown == {f"{k}_micros": v for k, v in per_kind.items()}
        assert await store.money.settle(run.id) == settled
        after = await store.orgs.get(org.id)
        assert (after.balance_micros, after.reserved_micros) == (50_000 - model_total, 0)
    finally:
        await store.close()
