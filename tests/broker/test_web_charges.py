"""Egress charges are batched into the ledger and journalled first: exact, and kept by a crash."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ephemeral.broker import attach, journal
from ephemeral.engine import exits
from ephemeral.engine.runtime import Runtime
from tests.broker.conftest import build_run


async def test_a_burst_of_charges_lands_exactly_in_one_transaction(runtime: Runtime) -> None:
    agent = await build_run(runtime, web=True)
    charges = agent.web
    for i in range(200):  # as the proxy decides them: synchronously, before the bytes move
        assert charges.charge_bytes(f"egress:1:{i}", 7) == 7
    await charges.flush()
    assert charges.batches == 1 and charges.error is None
    assert (await runtime.store.money.charged(agent.run_id))["web_micros"] == 1400
    assert agent.budget.charged["web_micros"] == 1400
    assert not journal.path_for(runtime.settings.state_dir, agent.run_id).exists()


async def test_request_events_are_written_with_their_charges_in_one_transaction(
    runtime: Runtime,
) -> None:
    agent = await build_run(runtime, web=True)
    before = len(await runtime.store.events.list(agent.run_id))
    for i in range(50):  # as the proxy does per request: its charge, then its event
        agent.web.charge_bytes(f"egress:{i}:0", 3)
        agent.record_event("web.requested", {"method": "GET", "host": "h", "n": i})
    await agent.web.flush()
    assert agent.web.batches == 1 and agent.web.error is None
    events = (await runtime.store.events.list(agent.run_id))[before:]
    assert [e.data["n"] for e in events if e.type == "web.requested"] == list(range(50))
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps, in order
    assert (await runtime.store.money.charged(agent.run_id))["web_micros"] == 150


async def test_an_event_alone_is_written_and_flushed(runtime: Runtime) -> None:
    agent = await build_run(runtime, web=True)
    agent.record_event("web.requested", {"method": "GET", "host": "h"})
    await agent.web.flush()
    assert [e.type for e in await runtime.store.events.list(agent.run_id)][-1] == "web.requested"


async def test_a_busy_store_is_tried_again(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = await build_run(runtime, web=True)
    real = runtime.store.money.charge_batch
    failures = [RuntimeError("database is locked")]

    async def flaky(*args: Any) -> int:
        if failures:
            raise failures.pop()
        return await real(*args)

    monkeypatch.setattr(runtime.store.money, "charge_batch", flaky)
    monkeypatch.setattr(attach, "WRITE_RETRY_SECONDS", (0.0,))
    agent.web.charge_bytes("egress:1:1", 5)
    await agent.web.flush()
    assert agent.web.error is None and not failures
    assert (await runtime.store.money.charged(agent.run_id))["web_micros"] == 5


async def test_charges_of_a_process_that_died_are_replayed_before_settling(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = await build_run(runtime, web=True)
    stuck = asyncio.Event()

    async def never(*args: Any) -> int:  # the process dies before its batch commits
        stuck.set()
        await asyncio.Event().wait()
        return 0

    real = runtime.store.money.charge_batch
    monkeypatch.setattr(runtime.store.money, "charge_batch", never)
    for i in range(3):
        agent.web.charge_bytes(f"egress:1:{i}", 100)
    await stuck.wait()
    assert agent.web._writer is not None
    agent.web._writer.cancel()
    monkeypatch.setattr(runtime.store.money, "charge_batch", real)
    path = journal.path_for(runtime.settings.state_dir, agent.run_id)
    assert len(journal.read(path, agent.run_id)) == 3
    assert (await runtime.store.money.charged(agent.run_id))["web_micros"] == 0

    # the settle path after a crash
    await runtime.engine.end(agent.run_id, exits.crashed("the run's process died"))
    row = await runtime.store.runs.get(agent.run_id)
    assert row.status == "failed" and row.settled_at is not None
    assert row.breakdown["web_micros"] == 300
    assert row.charged_micros + row.refunded_micros == row.reserved_micros
    assert not path.exists()


async def test_a_replay_counts_each_charge_once_and_skips_torn_lines(runtime: Runtime) -> None:
    agent = await build_run(runtime, web=True)
    agent.web.charge_bytes("egress:1:1", 40)
    await agent.web.flush()  # in the ledger; the journal is gone
    path = journal.path_for(runtime.settings.state_dir, agent.run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    rid = agent.run_id
    lines = [f"{rid}:egress:1:1\t40", f"{rid}:egress:1:2\t60", "run_other:egress:1:1\t9"]
    path.write_text("\n".join(lines) + f"\n{rid}:egress:1:3")  # the last line torn mid-write
    assert await journal.replay(runtime.store, runtime.settings.state_dir, rid) == 2
    assert (await runtime.store.money.charged(rid))["web_micros"] == 40 + 60
    assert not path.exists()
