"""Dispatch without Prefect: an "API" runtime hands runs to a "worker" runtime through a fake
:class:`~ephemeral.engine.executor.Dispatcher`, both on one SQLite store (two processes' view of
it). The Prefect part (task runs, task workers, real processes) is ``tests/cluster``; this covers
the runtime's side: ownerless admission, sealed ZDR content, cancel through the store, leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta

import pytest

from ephemeral.cluster import outbox
from ephemeral.engine import engine as engine_module
from ephemeral.engine.executor import Dispatcher, RunHandle
from ephemeral.engine.runtime import Runtime
from ephemeral.ids import new_run_id, utcnow
from ephemeral.lifecycle import RunStatus
from ephemeral.policy import RunRequest
from ephemeral.settings import Settings
from ephemeral.store import Store
from ephemeral.store.schema import sealed_content
from tests import runlevel
from tests.patience import PATIENCE
from tests.run.conftest import turn

pytestmark = [pytest.mark.sandbox]


class ToWorker:
    """The fake: what Prefect does, handing the run id to a worker runtime."""

    def __init__(self) -> None:
        self.worker: Runtime | None = None
        self.dispatched: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def dispatch(self, store: Store, run_id: str) -> None:
        worker = self.worker
        assert worker is not None
        self.dispatched.append(run_id)

        async def execute_run() -> None:  # what flows/dispatch.py's task does, minus Prefect
            if await worker.take(run_id):
                await worker.execute(run_id)

        self.tasks.append(asyncio.get_running_loop().create_task(execute_run()))

    async def execute(self, run: RunHandle) -> None:
        raise AssertionError("a dispatching runtime never executes")

    async def close(self) -> None:
        return None


@contextlib.asynccontextmanager
async def _pair(settings: Settings) -> AsyncIterator[tuple[Runtime, Runtime, ToWorker]]:
    """An API runtime that dispatches to a worker runtime, the worker closed first."""
    fake = ToWorker()
    assert isinstance(fake, Dispatcher)
    worker_settings = settings.model_copy(update={"host_id": "w1"})
    async with (
        runlevel.started(settings, executor=fake) as api,
        runlevel.started(worker_settings, recover=False) as worker,
    ):
        await worker.renew_leases(30)
        fake.worker = worker
        yield api, worker, fake


async def test_a_dispatched_zdr_run_crosses_sealed_and_is_read_once(
    run_settings: Settings, make_cassette: Callable[..., str]
) -> None:
    canary = "CANARY-dispatch-91b2"
    model = make_cassette("dispatch-zdr", [turn("echo hi"), turn(final=f"{canary} done")])
    async with _pair(run_settings) as (api, worker, fake):
        org = await api.local_org()
        row, _ = await api.submit(
            org, RunRequest(prompt=f"say {canary}", model=model, zero_data_retention=True)
        )
        assert row.owner is None  # no process owns it until a worker claims it
        assert fake.dispatched == [row.id]
        settled = await api.wait(row.id, timeout=PATIENCE)
        events = [e.type for e in await api.store.events.list(row.id)]
        first = await api.take_or_unseal_zdr_output(settled)
        second = await worker.take_or_unseal_zdr_output(settled)
        async with api.store.engine.connect() as conn:
            left = (await conn.execute(sealed_content.select())).all()
    assert settled.status == "succeeded", settled.termination_detail
    assert (settled.host, settled.owner == worker.owner) == ("w1", True)
    assert settled.prompt is None and settled.output is None
    assert events[:3] == ["run.queued", "run.claimed", "sandbox.ready"]
    assert first == f"{canary} done" and second is None
    assert left == []  # the prompt was taken by the worker, the output by its reader


async def test_a_hand_over_prefect_refuses_leaves_the_run_queued_for_the_outbox(
    run_settings: Settings, make_cassette: Callable[..., str]
) -> None:
    # Prefect's server answers 503 under load: the run must neither fail nor fail the POST,
    # it waits undispatched and the outbox hands it over again.
    model = make_cassette("dispatch-503", [turn(final="done")])

    async def refuse(run_id: str) -> None:
        raise RuntimeError("Server error '503 Service Unavailable' for url '.../task_runs/'")

    async with _pair(run_settings) as (api, _, fake):
        handed = fake.dispatch
        api.engine.dispatcher = refuse
        org = await api.local_org()
        row, _ = await api.submit(org, RunRequest(prompt="p", model=model))
        stored = await api.store.runs.get(row.id)
        assert (stored.status, stored.dispatched_at, stored.owner) == ("queued", None, None)
        assert fake.dispatched == []
        waiting = await api.store.outbox.undispatched(utcnow() + timedelta(seconds=1))
        assert [r.id for r in waiting] == [row.id]
        await outbox.hand_over(
            api.store, waiting[0], lambda run_id, _task_run: handed(api.store, run_id)
        )
        settled = await api.wait(row.id, timeout=PATIENCE)
    assert settled.status == "succeeded", settled.termination_detail
    assert settled.dispatched_at is not None and settled.host == "w1"


async def test_cancel_from_the_api_reaches_the_run_on_the_worker(
    run_settings: Settings, make_cassette: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The API's cancel asks the worker through the store and waits for the run to end
    # (CANCEL_WAIT_SECONDS, 10 s); at load 20 a worker can take longer, and the answer would then
    # be the row still running. Here the wait only stops a hang: what the test asserts is that
    # the answer is the run the worker ended, cancelled, not a run it let finish its sleep.
    monkeypatch.setattr(engine_module, "CANCEL_WAIT_SECONDS", PATIENCE)
    model = make_cassette("dispatch-sleep", [turn("sleep 60"), turn(final="slept")])
    async with _pair(run_settings) as (api, _, _):
        org = await api.local_org()
        row, _ = await api.submit(org, RunRequest(prompt="sleep", model=model))
        async with asyncio.timeout(PATIENCE):
            while "worker.started" not in [e.type for e in await api.store.events.list(row.id)]:
                await asyncio.sleep(0.05)
        t0 = time.monotonic()
        cancelled = await api.cancel(row.id)
        print(f"cancel answered in {time.monotonic() - t0:.2f} s")
        queued, _ = await api.admit(org, RunRequest(prompt="never", model=model))
        never = await api.cancel(queued.id)  # still waiting for a worker: closed at once
    # answered once the worker stopped it: the ended run, not the row the wait gave up on
    assert cancelled.status == "cancelled" and cancelled.settled
    assert cancelled.termination_reason == "cancelled"
    assert cancelled.output is None  # the sleep never reached the model's "slept"
    assert cancelled.charged_micros + cancelled.refunded_micros == cancelled.reserved_micros
    assert never.status == "cancelled" and never.settled and never.charged_micros == 0


async def test_an_expired_lease_is_settled_once_up_to_its_last_renewal(
    run_settings: Settings,
) -> None:
    async with (
        runlevel.started(run_settings, watchdog=False) as api,
        runlevel.started(run_settings, recover=False, watchdog=False) as other,
    ):
        org = await api.local_org()
        row, _ = await api.store.runs.admit(
            org_id=org,
            run_id=new_run_id(),
            model="replay/sandbox-proof",
            prompt="p",
            policy=RunRequest(prompt="p").policy().model_dump(mode="json"),
        )
        ready = utcnow()
        await api.store.runs.transition(
            row.id,
            expect={RunStatus.QUEUED},
            to=RunStatus.PROVISIONING,
            started_at=ready,
            host="dead",
            owner="elsewhere:1:1",  # another host: no pid check can judge it
            lease_renewed_at=ready,
            lease_expires_at=ready + timedelta(seconds=30),
        )
        await api.store.runs.transition(
            row.id,
            expect={RunStatus.PROVISIONING},
            to=RunStatus.RUNNING,
            events=[("sandbox.ready", {"isolation": "gvisor", "image": "x", "boot_ms": 1})],
        )
        assert await api.sweep() == []  # the lease has not run out yet
        # the host renewed 2 s after its sandbox was ready, then died
        [ready_event] = [
            e for e in await api.store.events.list(row.id) if e.type == "sandbox.ready"
        ]
        renewed = _parse(ready_event.at) + timedelta(seconds=2)
        await api.store.leases.renew(
            [row.id],
            owner="elsewhere:1:1",
            renewed_at=renewed,
            expires_at=utcnow() - timedelta(seconds=1),
        )
        found = await asyncio.gather(api.settle_expired_leases(), other.settle_expired_leases())
        settled = await api.store.runs.get(row.id)
        events = await api.store.events.list(row.id)
    assert sorted(found, key=len)[-1] == [row.id]
    assert (settled.status, settled.termination_reason) == ("failed", "infra_error")
    assert "host dead stopped renewing" in (settled.termination_detail or "")
    types = [e.type for e in events]
    assert types.count("run.settled") == 1 and types.count("sandbox.destroyed") == 1
    lifetime = next(e for e in events if e.type == "sandbox.destroyed").data["lifetime_ms"]
    # charged from sandbox.ready to the last renewal, not to the last event (the ready one)
    assert lifetime == 2000
    assert settled.breakdown.get("compute_micros", 0) > 0
    assert settled.charged_micros + settled.refunded_micros == settled.reserved_micros


def _parse(at: str) -> datetime:
    return datetime.fromisoformat(at.replace("Z", "+00:00"))


async def test_a_taken_run_waiting_on_a_dead_worker_is_refunded_in_full(
    run_settings: Settings,
) -> None:
    async with (
        runlevel.started(run_settings, watchdog=False) as api,
        runlevel.started(
            run_settings.model_copy(update={"host_id": "w9"}), recover=False, watchdog=False
        ) as worker,
    ):
        await worker.renew_leases(30)
        org = await api.local_org()
        row, _ = await api.store.runs.admit(
            org_id=org,
            run_id=new_run_id(),
            model="replay/sandbox-proof",
            prompt="p",
            policy=RunRequest(prompt="p").policy().model_dump(mode="json"),
        )
        assert await worker.take(row.id) is True
        taken = await api.store.runs.get(row.id)
        assert (taken.status, taken.host, taken.owner) == ("queued", "w9", worker.owner)
        assert await worker.take(row.id) is True  # still queued: taking again is harmless
        # a late renewal of the run's lease (a busy worker, a locked row) is not the worker's
        # death: its process lease still holds
        await api.store.leases.renew(
            [row.id],
            owner=worker.owner,
            renewed_at=utcnow(),
            expires_at=utcnow() - timedelta(seconds=1),
        )
        assert await api.settle_expired_leases() == []
        # the worker dies while the run waits for a slot: its process lease goes, the run's
        # lease runs out
        assert worker.process_lease is not None
        await worker.process_lease.stop()
        await api.store.leases.renew(
            [row.id],
            owner=worker.owner,
            renewed_at=utcnow(),
            expires_at=utcnow() - timedelta(seconds=1),
        )
        assert await api.settle_expired_leases() == [row.id]
        settled = await api.store.runs.get(row.id)
        assert await worker.engine.grant(row.id) is False  # nothing left to start
        # what the worker's task (flows/dispatch.py) does then: it finds the run settled and
        # lets it go (the run-level check found the engine still holding it without this)
        assert (await worker.execute(row.id)).status == "failed"
    assert (settled.status, settled.termination_reason) == ("failed", "infra_error")
    assert (settled.charged_micros, settled.refunded_micros) == (0, settled.reserved_micros)
