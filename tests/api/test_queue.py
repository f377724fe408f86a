"""Queueing is free and bounded; nothing stays open (issue 12).

A real runtime with one execution slot: one run executes (`sleep 30`), the next waits `queued`,
and a third is refused with 429 before anything is reserved. The watchdog and the failure path
close runs that nothing would otherwise finish.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from ephemeral.api import create_app
from ephemeral.engine.runtime import Runtime
from ephemeral.lifecycle import TERMINAL_STATUSES
from ephemeral.policy import RunRequest
from ephemeral.sandbox import handles
from ephemeral.settings import Settings
from tests import runlevel
from tests.api.conftest import SAMPLE_BODY, Member, new_member
from tests.patience import PATIENCE

pytestmark = pytest.mark.sandbox

SLOW = {**SAMPLE_BODY, "model": "replay/api-slow"}


@pytest.fixture
async def one_slot(api_settings: Settings) -> AsyncIterator[Runtime]:
    settings = api_settings.model_copy(update={"max_concurrent_runs": 1, "max_queued_runs": 1})
    async with runlevel.started(settings, check=True) as rt:
        yield rt


@pytest.fixture
async def http1(api_settings: Settings, one_slot: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    app: FastAPI = create_app(api_settings, one_slot)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield client


async def _until(runtime: Runtime, run_id: str, event: str, timeout: float = 60) -> None:
    async with asyncio.timeout(timeout):
        while event not in [e.type for e in await runtime.store.events.list(run_id)]:
            await asyncio.sleep(0.05)


def _sandbox_owners(settings: Settings) -> set[str]:
    return {h.owner for _, h in handles.read_all(settings.sandboxes_dir) if h is not None}


async def test_queued_run_holds_nothing_and_429_past_the_bound_reserves_nothing(
    http1: httpx.AsyncClient, one_slot: Runtime
) -> None:
    member: Member = await new_member(one_slot, "queue")
    first = (await http1.post("/v1/runs", json=SLOW, headers=member.headers)).json()
    await _until(one_slot, first["id"], "worker.started")
    second = (await http1.post("/v1/runs", json=SLOW, headers=member.headers)).json()
    assert second["status"] == "queued"

    await asyncio.sleep(0.5)  # it would have been given a sandbox by now if it were going to
    queued = await one_slot.store.runs.get(second["id"])
    assert queued.status == "queued" and queued.started_at is None
    assert [e.type for e in await one_slot.store.events.list(second["id"])] == ["run.queued"]
    assert second["id"] not in _sandbox_owners(one_slot.settings)
    assert first["id"] in _sandbox_owners(one_slot.settings)

    org_before = await one_slot.store.orgs.get(member.org_id)
    refused = await http1.post(
        "/v1/runs", json=SLOW, headers={**member.headers, "Idempotency-Key": "full-queue"}
    )
    assert refused.status_code == 429
    assert refused.headers["content-type"].startswith("application/problem+json")
    assert refused.json()["type"].endswith("/queue-full")
    assert int(refused.headers["retry-after"]) >= 1
    org_after = await one_slot.store.orgs.get(member.org_id)
    assert org_after.reserved_micros == org_before.reserved_micros == 2 * 40_000
    assert org_after.balance_micros == org_before.balance_micros
    runs, _ = await one_slot.store.runs.list(member.org_id, limit=10)
    assert len(runs) == 2

    # A queued run cancelled before its slot is charged nothing and never had a sandbox.
    cancelled = (await http1.post(f"/v1/runs/{second['id']}/cancel", headers=member.headers)).json()
    assert cancelled["status"] == "cancelled"
    assert cancelled["cost"]["charged_micros"] == 0
    assert cancelled["cost"]["refunded_micros"] == SLOW["max_cost_micros"]
    types = [e.type for e in await one_slot.store.events.list(second["id"])]
    assert "sandbox.ready" not in types and types[-1] == "run.settled"

    await http1.post(f"/v1/runs/{first['id']}/cancel", headers=member.headers)
    row = await one_slot.wait(first["id"], timeout=PATIENCE)
    assert row.charged_micros + row.refunded_micros == row.reserved_micros
    assert (await one_slot.store.orgs.get(member.org_id)).reserved_micros == 0


async def test_queue_wait_is_reported_and_not_billed(
    http1: httpx.AsyncClient, one_slot: Runtime
) -> None:
    member = await new_member(one_slot, "wait")
    first = (await http1.post("/v1/runs", json=SAMPLE_BODY, headers=member.headers)).json()
    second = (await http1.post("/v1/runs", json=SAMPLE_BODY, headers=member.headers)).json()
    await one_slot.wait(first["id"], timeout=PATIENCE)
    row = await one_slot.wait(second["id"], timeout=PATIENCE)
    assert row.status == "succeeded"
    events = await one_slot.store.events.list(second["id"])
    ready = next(e for e in events if e.type == "sandbox.ready")
    assert row.started_at is not None
    waited = (row.started_at - row.created_at).total_seconds() * 1000
    assert abs(ready.data["queue_wait_ms"] - waited) <= 2
    assert ready.data["queue_wait_ms"] > 0  # it waited for the first run's slot
    lifetime = next(e for e in events if e.type == "sandbox.destroyed").data["lifetime_ms"]
    end = row.ended_at
    assert end is not None
    assert lifetime <= (end - row.started_at).total_seconds() * 1000 + 50


async def test_watchdog_finishes_a_run_whose_task_is_gone(runtime: Runtime) -> None:
    member = await new_member(runtime, "orphan")
    row, _ = await runtime.admit(member.org_id, RunRequest(prompt="never launched"))
    assert row.id not in await runtime.sweep()  # one sweep: it may be about to execute
    assert row.id in await runtime.sweep()
    done = await runtime.store.runs.get(row.id)
    assert done.status == "failed" and done.termination_reason == "infra_error"
    assert "watchdog" in (done.termination_detail or "")
    assert done.charged_micros == 0 and done.refunded_micros == done.reserved_micros
    assert (await runtime.store.events.list(row.id))[-1].type == "run.settled"
    assert (await runtime.store.orgs.get(member.org_id)).reserved_micros == 0


async def test_watchdog_leaves_a_run_a_worker_took_for_a_slot(runtime: Runtime) -> None:
    """A worker at its limit takes the next run (still queued) with no task until a slot
    frees (flows/worker.py); under load that takes longer than two sweeps."""
    member = await new_member(runtime, "held")
    row, _ = await runtime.admit(member.org_id, RunRequest(prompt="held at the limit"))
    runtime.taken = {row.id}
    for _ in range(3):
        assert row.id not in await runtime.sweep()
    assert (await runtime.store.runs.get(row.id)).status == "queued"
    runtime.taken = set()  # let go (never taken): the watchdog's again
    assert row.id not in await runtime.sweep()
    assert row.id in await runtime.sweep()


async def test_an_exception_on_the_execution_path_settles_the_run(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    member = await new_member(runtime, "broken")

    async def broken_build(run_id: str) -> None:
        raise ConnectionError("database went away")

    monkeypatch.setattr(runtime.engine, "build", broken_build)
    row, _ = await runtime.submit(member.org_id, RunRequest(prompt="hello"))
    done = await runtime.wait(row.id, timeout=PATIENCE)
    assert done.status in TERMINAL_STATUSES and done.termination_reason == "infra_error"
    assert "ConnectionError: database went away" in (done.termination_detail or "")
    assert done.charged_micros + done.refunded_micros == done.reserved_micros
    assert (await runtime.store.orgs.get(member.org_id)).reserved_micros == 0


async def test_client_waits_out_a_full_queue(api_settings: Settings) -> None:
    """A real 429 from a full queue: the client waits Retry-After and the retry is admitted."""
    from ephemeral.client import AsyncClient

    settings = api_settings.model_copy(update={"max_concurrent_runs": 1, "max_queued_runs": 0})
    async with runlevel.started(settings) as rt:
        member = await new_member(rt, "patient")
        app = create_app(settings, rt)
        seen: list[int] = []

        class Recorder(httpx.AsyncBaseTransport):
            inner = httpx.ASGITransport(app=app)

            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                response = await self.inner.handle_async_request(request)
                if request.method == "POST" and request.url.path == "/v1/runs":
                    seen.append(response.status_code)
                return response

        client = AsyncClient(
            Settings.load(url="http://testserver", api_key=member.key), transport=Recorder()
        )
        async with client:
            first = await client.runs.create(request=RunRequest.model_validate(SLOW))
            second = asyncio.create_task(
                client.runs.create(request=RunRequest.model_validate(SAMPLE_BODY))
            )
            async with asyncio.timeout(PATIENCE):
                while 429 not in seen:
                    await asyncio.sleep(0.05)
            await client.runs.cancel(first["id"])
            run = await second
            assert seen[:2] == [201, 429] and seen[-1] == 201
            done = await client.runs.wait(run["id"], timeout=PATIENCE)
            assert done["status"] == "succeeded"
