"""Status transitions: each is one transaction, guarded by the status the run must be in."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

from ephemeral import errors
from ephemeral.ids import new_run_id, utcnow
from ephemeral.lifecycle import (
    STATUS_FOR_REASON,
    TERMINAL_STATUSES,
    TRANSITIONS,
    RunStatus,
    TerminationReason,
    check_transition,
)
from ephemeral.store import Org, RunRow, Store
from ephemeral.store.schema import runs
from tests.store.storehelp import force_status, policy

USAGE = {"model_calls": 1, "input_tokens": 10, "output_tokens": 2}


async def _run(store: Store, org: Org) -> RunRow:
    run, _ = await store.runs.admit(
        org_id=org.id, run_id=new_run_id(), model="replay/x", prompt="p", policy=policy(10_000)
    )
    return run


async def _types(store: Store, run_id: str) -> list[str]:
    return [e.type for e in await store.events.list(run_id)]


async def test_transition_writes_row_and_events_only_from_the_expected_status(
    store: Store, org: Org
) -> None:
    run = await _run(store, org)
    started = await store.runs.transition(
        run.id, expect={RunStatus.QUEUED}, to=RunStatus.PROVISIONING, started_at=utcnow()
    )
    assert started.status == "provisioning" and started.started_at is not None
    with pytest.raises(errors.Conflict, match="provisioning"):
        await store.runs.transition(
            run.id,
            expect={RunStatus.QUEUED},
            to=RunStatus.RUNNING,
            events=[("sandbox.ready", {"boot_ms": 1})],
        )
    assert await _types(store, run.id) == ["run.queued"]  # the refused move wrote nothing
    ready = await store.runs.transition(
        run.id,
        expect={RunStatus.PROVISIONING},
        to=RunStatus.RUNNING,
        events=[("sandbox.ready", {"boot_ms": 1}), ("worker.started", {"shell": True})],
        sandbox_id="sbx",
    )
    assert (ready.status, ready.sandbox_id) == ("running", "sbx")
    listed = await store.events.list(run.id)
    assert [(e.seq, e.type) for e in listed] == [
        (1, "run.queued"),
        (2, "sandbox.ready"),
        (3, "worker.started"),
    ]
    assert listed[2].data == {"shell": True}
    with pytest.raises(errors.InvalidRequest):  # ending a run is runs.close's job
        await store.runs.transition(run.id, expect={RunStatus.RUNNING}, to=RunStatus.SUCCEEDED)


async def test_close_run_ends_settles_and_publishes_at_once(store: Store, org: Org) -> None:
    run = await _run(store, org)
    await store.money.charge(run.id, "model", 1_234, key=f"{run.id}:model:0")
    row, settlement = await store.runs.close(
        run.id, reason=TerminationReason.COMPLETED, detail=None, usage=USAGE, output="# done"
    )
    assert (row.status, row.termination_reason, row.output) == ("succeeded", "completed", "# done")
    assert row.settled and row.ended_at is not None
    assert (settlement.charged_micros, settlement.refunded_micros) == (1_234, 10_000 - 1_234)
    events = await store.events.list(run.id)
    assert [e.type for e in events] == ["run.queued", "run.succeeded", "run.output", "run.settled"]
    assert events[1].data == {"model_calls": 1, "tokens": 12, "reason": "completed"}
    assert events[-1].data["charged_micros"] == 1_234
    assert (await store.orgs.get(org.id)).reserved_micros == 0

    # A second close (the runtime abandoning a run its agent just ended) changes nothing.
    again, same = await store.runs.close(
        run.id, reason=TerminationReason.CANCELLED, detail="late", usage={}, output=None
    )
    assert (again.status, same) == ("succeeded", settlement)
    assert len(await store.events.list(run.id)) == 4


async def test_concurrent_closes_end_the_run_once(store: Store, org: Org) -> None:
    run = await _run(store, org)
    reasons = [TerminationReason.COMPLETED, TerminationReason.CANCELLED] * 3
    rows = await asyncio.gather(
        *(
            store.runs.close(run.id, reason=r, detail=None, usage=USAGE, output=None)
            for r in reasons
        )
    )
    assert len({row.status for row, _ in rows}) == 1
    types = await _types(store, run.id)
    assert types.count("run.settled") == 1 and len(types) == 3
    assert (await store.orgs.get(org.id)).reserved_micros == 0


async def test_a_failing_close_leaves_the_run_open_and_unsettled(store: Store, org: Org) -> None:
    run = await _run(store, org)
    await store.money.charge(run.id, "model", 100, key=f"{run.id}:model:0")
    async with store.engine.begin() as conn:  # the run's total no longer matches its ledger
        await conn.execute(sa.update(runs).where(runs.c.id == run.id).values(charged_micros=99))
    with pytest.raises(errors.EphemeralError, match="ledger"):
        await store.runs.close(
            run.id, reason=TerminationReason.COMPLETED, detail=None, usage=USAGE, output="x"
        )
    row = await store.runs.get(run.id)
    assert (row.status, row.settled, row.ended_at) == ("queued", False, None)
    assert await _types(store, run.id) == ["run.queued"]
    assert (await store.orgs.get(org.id)).reserved_micros == 10_000


async def test_close_run_settles_a_run_an_older_version_left_terminal(
    store: Store, org: Org
) -> None:
    run = await _run(store, org)
    await force_status(store, run.id, "failed", "infra_error")
    assert [r.id for r in await store.runs.unsettled()] == [run.id]
    row, settlement = await store.runs.close(
        run.id, reason=TerminationReason.INFRA_ERROR, detail="unsettled", usage={}, output="x"
    )
    assert (row.status, row.settled, settlement.refunded_micros) == ("failed", True, 10_000)
    assert await _types(store, run.id) == ["run.queued", "run.settled"]
    assert await store.runs.unsettled() == []


async def test_compute_charge_and_its_event_are_one_fact(store: Store, org: Org) -> None:
    run = await _run(store, org)
    key = f"{run.id}:compute"
    destroyed = ("sandbox.destroyed", {"lifetime_ms": 5})
    assert await store.money.charge(run.id, "compute", 50, key=key, event=destroyed) == 50
    assert (
        await store.money.charge(run.id, "compute", 50, key=key, event=destroyed) == 50
    )  # a retry
    assert await _types(store, run.id) == ["run.queued", "sandbox.destroyed"]
    with pytest.raises(errors.BudgetExhausted):
        await store.money.charge(run.id, "compute", 10_000, key=f"{key}:2", event=destroyed)
    assert await _types(store, run.id) == ["run.queued", "sandbox.destroyed"]


# One reason per terminal status, to close a run into it.
REASON_FOR = {status: reason for reason, status in reversed(STATUS_FOR_REASON.items())}


async def _run_in(store: Store, org: Org, status: RunStatus) -> RunRow:
    """A run brought to ``status`` by legal moves only."""
    run = await _run(store, org)
    if status == RunStatus.QUEUED:
        return run
    if status in TERMINAL_STATUSES:
        row, _ = await store.runs.close(
            run.id, reason=REASON_FOR[status], detail=None, usage={}, output=None
        )
        return row
    return await store.runs.transition(run.id, expect={RunStatus.QUEUED}, to=status)


async def _move(store: Store, run_id: str, start: RunStatus, to: RunStatus) -> RunRow:
    if to in TERMINAL_STATUSES:
        row, _ = await store.runs.close(
            run_id, reason=REASON_FOR[to], detail=None, usage=USAGE, output="x", expect={start}
        )
        return row
    return await store.runs.transition(
        run_id, expect={start}, to=to, events=[("sandbox.ready", {"boot_ms": 1})]
    )


@pytest.mark.parametrize(
    ("start", "to"),
    [(a, b) for a in RunStatus for b in RunStatus],
    ids=lambda s: str(s),
)
async def test_every_status_pair_is_legal_only_if_the_table_says_so(
    store: Store, org: Org, start: RunStatus, to: RunStatus
) -> None:
    run = await _run_in(store, org, start)
    before = (await store.runs.get(run.id), await _types(store, run.id))
    balance = (await store.orgs.get(org.id)).model_dump()
    if (start, to) in TRANSITIONS:
        row = await _move(store, run.id, start, to)
        assert row.status == to
        assert (await store.runs.get(run.id)).status == to
        return
    with pytest.raises(errors.IllegalTransition, match=f"{start} -> {to}"):
        await _move(store, run.id, start, to)
    assert (await store.runs.get(run.id), await _types(store, run.id)) == before
    assert (await store.orgs.get(org.id)).model_dump() == balance


def test_the_table_ends_runs_only_from_open_statuses() -> None:
    assert {to for _, to in TRANSITIONS} >= TERMINAL_STATUSES
    assert not {start for start, _ in TRANSITIONS} & TERMINAL_STATUSES
    assert (RunStatus.RUNNING, RunStatus.QUEUED) not in TRANSITIONS  # no way back
    with pytest.raises(errors.IllegalTransition, match="must name"):
        check_transition((), RunStatus.RUNNING)
