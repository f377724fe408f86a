"""Runs, their events and content: seq order, paging, updates, erasure and retention."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from ephemeral import errors
from ephemeral.ids import new_run_id, utcnow
from ephemeral.lifecycle import RunStatus, TerminationReason
from ephemeral.store import Org, RunRow, Store
from ephemeral.store.schema import ledger
from tests.store.storehelp import force_status, policy

CANARY = "CANARY-7f3a9c-not-for-storage"


async def _run(store: Store, org: Org, **pol: object) -> RunRow:
    run, _ = await store.runs.admit(
        org_id=org.id,
        run_id=new_run_id(),
        model="replay/x",
        prompt=f"echo {CANARY}",
        policy=policy(10_000, **pol),
    )
    return run


async def test_concurrent_appends_get_gapless_seqs(store: Store, org: Org) -> None:
    run = await _run(store, org)
    appended = await asyncio.gather(
        *(store.events.append(run.id, "model.called", {"i": i}) for i in range(100))
    )
    assert sorted(e.seq for e in appended) == list(range(2, 102))
    listed = await store.events.list(run.id)
    assert [e.seq for e in listed] == list(range(1, 102))
    assert {e.data.get("i") for e in listed[1:]} == set(range(100))
    assert [e.seq for e in await store.events.list(run.id, after_seq=99)] == [100, 101]
    assert listed[1].at.endswith("Z") and len(listed[1].at) == len("2026-01-01T00:00:00.000Z")


async def test_event_validation(store: Store, org: Org) -> None:
    run = await _run(store, org)
    with pytest.raises(errors.InvalidRequest):
        await store.events.append(run.id, "Not A Type", {})
    with pytest.raises(errors.InvalidRequest) as info:
        await store.events.append(run.id, "shell.executed", {"stdout": "x" * (2 << 20)})
    assert info.value.errors and info.value.errors[0]["field"] == "data"
    with pytest.raises(errors.NotFound):
        await store.events.append("run_" + "0" * 32, "run.queued", {})
    with pytest.raises(errors.NotFound):
        await store.events.list("run_" + "0" * 32)


async def test_an_event_with_usage_sets_the_runs_usage_with_it(store: Store, org: Org) -> None:
    run = await _run(store, org)
    event = await store.events.append(run.id, "sandbox.exec", {"n": 1}, usage={"execs": 1})
    assert event.seq == 2
    assert (await store.runs.get(run.id)).usage == {"execs": 1}
    with pytest.raises(errors.InvalidRequest) as info:
        await store.events.append(run.id, "sandbox.exec", {"n": 2}, usage=["not", "an", "object"])  # type: ignore[arg-type]
    assert info.value.errors and info.value.errors[0]["field"] == "usage"
    assert [e.seq for e in await store.events.list(run.id)] == [1, 2]  # the refused one: nothing
    assert (await store.runs.get(run.id)).usage == {"execs": 1}


async def test_zero_data_retention_keeps_no_content(store: Store, org: Org) -> None:
    run = await _run(store, org, zero_data_retention=True)
    event = await store.events.append(
        run.id,
        "shell.executed",
        {
            "command": f"echo {CANARY}",
            "exit_code": 0,
            "stdout": CANARY,
            "stderr": "",
            "duration_ms": 3,
            "truncated": False,
        },
    )
    assert CANARY not in str(event.data)
    assert event.data["command_bytes"] == len(f"echo {CANARY}") and event.data["exit_code"] == 0
    await store.transcripts.save(run.id, [{"role": "user", "content": CANARY}])
    assert await store.transcripts.get(run.id) is None


@pytest.mark.parametrize("zdr", [False, True])
async def test_a_charge_batch_numbers_its_events_after_the_rest(
    store: Store, org: Org, zdr: bool
) -> None:
    run = await _run(store, org, zero_data_retention=zdr)
    await store.events.append(run.id, "run.started", {})
    path = f"/{CANARY}"
    events = [("web.requested", {"method": "GET", "path": path, "n": i}) for i in range(3)]
    await store.money.charge_batch(run.id, "web", [("w:1", 5)], events)
    await store.money.charge_batch(run.id, "web", [], events[:1])
    await store.events.append(run.id, "run.completed", {})
    got = await store.events.list(run.id)
    assert [e.seq for e in got] == list(range(1, len(got) + 1))
    assert [e.type for e in got][1:] == ["run.started"] + ["web.requested"] * 4 + ["run.completed"]
    web = [e.data for e in got if e.type == "web.requested"]
    assert (CANARY in str(web)) is not zdr
    if not zdr:
        assert [d["n"] for d in web] == [0, 1, 2, 0]


async def test_erase_content_keeps_billing(store: Store, org: Org) -> None:
    run = await _run(store, org)
    await store.events.append(
        run.id, "shell.executed", {"command": f"echo {CANARY}", "stdout": CANARY, "exit_code": 0}
    )
    await store.events.append(run.id, "run.output", {"markdown": CANARY})
    await store.transcripts.save(run.id, [{"role": "user", "content": CANARY}])
    await store.runs.update(run.id, output=CANARY, usage={"model_calls": 1})
    await store.money.charge(run.id, "model", 123, "m1")
    settled = await store.money.settle(run.id)

    await store.retention.erase(run.id)

    after = await store.runs.get(run.id)
    assert after.prompt is None and after.output is None and after.erased_at is not None
    assert await store.transcripts.get(run.id) is None
    events = await store.events.list(run.id)
    assert CANARY not in str([e.data for e in events])
    assert [e.type for e in events] == ["run.queued", "shell.executed", "run.output"]
    assert events[1].data["exit_code"] == 0 and events[2].data["markdown_bytes"] == len(CANARY)
    assert (after.charged_micros, after.refunded_micros) == (123, settled.refunded_micros)
    assert after.usage == {"model_calls": 1}
    assert await store.money.charged(run.id) == settled.breakdown
    # A late event after erasure is stored redacted too.
    late = await store.events.append(run.id, "shell.executed", {"stdout": CANARY})
    assert CANARY not in str(late.data)
    await store.transcripts.save(run.id, [{"content": CANARY}])
    assert await store.transcripts.get(run.id) is None
    async with store.engine.connect() as conn:
        kinds = (
            (
                await conn.execute(
                    sa.select(ledger.c.kind).where(ledger.c.run_id == run.id).order_by(ledger.c.id)
                )
            )
            .scalars()
            .all()
        )
    assert kinds == ["reserve", "model", "settle", "refund"]


async def test_erased_content_is_gone_from_the_sqlite_files(
    sqlite_store: Store, sqlite_url: str
) -> None:
    org = await sqlite_store.orgs.ensure("zdr", initial_credit_micros=100_000)
    run = await _run(sqlite_store, org)
    await sqlite_store.events.append(run.id, "run.output", {"markdown": CANARY * 20})
    await sqlite_store.transcripts.save(run.id, [{"content": CANARY * 20}])
    await sqlite_store.retention.erase(run.id)
    await sqlite_store.close()
    db = Path(sqlite_url.split("///", 1)[1])
    files = [p for p in db.parent.iterdir() if p.name.startswith(db.name)]
    assert files
    for path in files:
        assert CANARY.encode() not in path.read_bytes(), path.name


async def test_transcript_roundtrip_and_overwrite(store: Store, org: Org) -> None:
    run = await _run(store, org)
    assert await store.transcripts.get(run.id) is None
    await store.transcripts.save(run.id, [{"role": "user", "content": "a"}])
    await store.transcripts.save(
        run.id, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    )
    assert await store.transcripts.get(run.id) == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]


async def test_update_run_fields_and_guard(store: Store, org: Org) -> None:
    run = await _run(store, org)
    now = utcnow()
    updated = await store.runs.update(
        run.id, isolation="gvisor", sandbox_id="sb-1", started_at=now, owner="host:123"
    )
    assert (updated.status, updated.isolation, updated.sandbox_id, updated.owner) == (
        "queued",
        "gvisor",
        "sb-1",
        "host:123",
    )
    assert updated.started_at is not None
    assert abs(updated.started_at - now) < timedelta(milliseconds=1)
    for bad in (
        # The lifecycle moves only with its events (tests/store/test_store_lifecycle.py).
        {"status": "succeeded"},
        {"termination_reason": "completed"},
        {"ended_at": now},
        {"reserved_micros": 1},
        {"usage": "x"},
        {"started_at": now.replace(tzinfo=None)},
    ):
        with pytest.raises(errors.InvalidRequest) as info:
            await store.runs.update(run.id, **bad)
        assert info.value.errors and info.value.errors[0]["field"] == next(iter(bad))
    assert (await store.runs.get(run.id)).status == "queued"
    with pytest.raises(errors.NotFound):
        await store.runs.update("run_" + "0" * 32, owner="x")


async def test_open_and_unsettled_runs(store: Store, org: Org) -> None:
    queued = await _run(store, org)
    finished = await _run(store, org)
    settled = await _run(store, org)
    await force_status(store, finished.id, "failed", "infra_error")  # as an older version could
    await store.runs.close(
        settled.id, reason=TerminationReason.COMPLETED, detail=None, usage={}, output=None
    )
    assert [r.id for r in await store.runs.open()] == [queued.id]
    assert [r.id for r in await store.runs.unsettled()] == [finished.id]


async def test_list_runs_pages_newest_first(store: Store, org: Org) -> None:
    ids = [(await _run(store, org)).id for _ in range(7)]
    await store.runs.transition(ids[3], expect={RunStatus.QUEUED}, to=RunStatus.RUNNING)
    seen: list[str] = []
    cursor: str | None = None
    while True:
        page, cursor = await store.runs.list(org.id, limit=3, cursor=cursor)
        seen += [r.id for r in page]
        if cursor is None:
            break
    assert seen == ids[::-1]
    running, nxt = await store.runs.list(org.id, status="running")
    assert [r.id for r in running] == [ids[3]] and nxt is None
    with pytest.raises(errors.InvalidRequest) as info:
        await store.runs.list(org.id, cursor="garbage!")
    assert info.value.errors and info.value.errors[0]["field"] == "cursor"
    for bad in ({"limit": 0}, {"limit": 101}, {"status": "nope"}):
        with pytest.raises(errors.InvalidRequest):
            await store.runs.list(org.id, **bad)  # type: ignore[arg-type]


async def test_another_orgs_run_is_not_found(store: Store, org: Org) -> None:
    run = await _run(store, org)
    other = await store.orgs.ensure("other", initial_credit_micros=100_000)
    assert (await store.runs.get(run.id, org.id)).id == run.id
    with pytest.raises(errors.NotFound):
        await store.runs.get(run.id, other.id)
    assert await store.runs.list(other.id) == ([], None)
