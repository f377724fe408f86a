"""``ephemeral worker``: one host's share of a scale-out deployment (docs/deploy.md).

One process per host: a Prefect task worker serving ``execute-run``, with this host's runtime
on the same event loop (its warm pool, its leases and cancel watch, its watchdog, and the
reaper that ran at start), and the admission outbox (ephemeral.cluster.outbox). Before serving it
makes sure the global concurrency limits exist: ``microvm:<host>`` at ``--limit`` (created or
updated) and ``microvm-total`` (created if missing; an operator sets its real value).

**Drain.** SIGTERM, SIGINT or ``ephemeral worker --drain`` (a SIGTERM to the pid in
``<state dir>/worker.pid``) stops the subscription, so Prefect hands this host no more runs.
Runs the host holds but has not started go back to the queue at once under a fresh task run
(``hand_back``); running ones get up to ``drain_seconds`` to finish; then, or at a second
signal, the rest are ended ``cancelled`` with the drain as the reason (settled at once, their
sandboxes destroyed). Their Prefect slots are released as each run's body returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any
from uuid import UUID

from prefect.task_worker import TaskWorker

from ephemeral.cluster import outbox
from ephemeral.engine.runtime import Runtime, freeze_startup_heap
from ephemeral.flows.dispatch import (
    TOTAL_LIMIT,
    create_task_run,
    execute_run_task,
    hand_back,
    host_limit,
    mark_crashed,
)
from ephemeral.ids import utcnow
from ephemeral.owner import this_process
from ephemeral.settings import Settings

log = logging.getLogger("ephemeral.flows.worker")

PID_FILE = "worker.pid"
DRAIN_POLL_SECONDS = 0.2
TAKE_SECONDS = 60.0  # from a held run's token to the runtime's take, at most (seconds, loaded)


async def ensure_limits(host: str, limit: int, total: int) -> None:
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    async with get_client() as client:
        await client.upsert_global_concurrency_limit_by_name(host_limit(host), limit)
        try:
            await client.read_global_concurrency_limit_by_name(TOTAL_LIMIT)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another host made it first
                await client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=TOTAL_LIMIT, limit=total)
                )


class HostWorker(TaskWorker):
    """Prefect's task worker with a drain, and with every run it receives claimed at once.

    Prefect's worker receives (and acknowledges) the next task run before it waits for a free
    token of its limit, so at its limit it holds one run Prefect will not give anyone else.
    That run is claimed here (``queued``, this host, a lease renewed by :meth:`_renew`): if the
    worker dies it is settled through its lease, and a drain hands it back.
    """

    def __init__(self, runtime: Runtime, drain_seconds: float, limit: int) -> None:
        super().__init__(execute_run_task(runtime), limit=limit)
        self.runtime = runtime
        self.drain_seconds = drain_seconds
        self.signals = 0
        self._drain = asyncio.Event()
        self._now = asyncio.Event()
        self._held: dict[UUID, str] = {}  # task run id -> run id, waiting for a token
        # run id -> when its token came: renewed here until the runtime took it (its parameters
        # are read and Prefect's engine starts in between: seconds on a loaded host)
        self._claimed: dict[str, float | None] = {}
        runtime.holding = self._claimed  # so its watchdog does not end them as unexecuted
        self._loop = asyncio.get_running_loop()
        self.on_drain: list[Callable[[], Awaitable[None]]] = []  # run as the drain begins

    def handle_sigterm(self, signum: int, frame: object) -> None:
        # Prefect installs this as it starts; its own exits at once. Ours drains, and a second
        # signal ends the rest now.
        self._loop.call_soon_threadsafe(self.signal)

    def signal(self) -> None:
        self.runtime.draining = True
        self.signals += 1
        (self._drain if self.signals == 1 else self._now).set()

    async def _acquire_token(self, task_run_id: UUID) -> bool:
        if self._limiter is not None and self._limiter.available_tokens < 1:
            try:
                await self._hold(task_run_id)
            except Exception:  # unclaimed it is still served when a token frees
                log.exception("task run %s: could not claim the run it carries", task_run_id)
        try:
            return await super()._acquire_token(task_run_id)
        finally:
            run_id = self._held.pop(task_run_id, None)
            if run_id is not None:
                self._claimed[run_id] = time.monotonic()

    async def _hold(self, task_run_id: UUID) -> None:
        run_id = (await self._client.read_task_run(task_run_id)).name  # named for its run
        self._held[task_run_id] = run_id
        self._claimed[run_id] = None
        now = utcnow()
        await self.runtime.store.outbox.take(
            run_id,
            host=self.runtime.host,
            owner=self.runtime.owner,
            renewed_at=now,
            expires_at=now + _seconds(self.runtime.settings.lease_seconds),
        )

    async def _subscribe_to_task_scheduling(self) -> None:
        subscription = asyncio.ensure_future(super()._subscribe_to_task_scheduling())
        drain = asyncio.ensure_future(self._drain.wait())
        renew = asyncio.ensure_future(self._renew())
        try:
            await asyncio.wait({subscription, drain}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            drain.cancel()
        if subscription.done():  # it ended by itself (an error): no drain, the error is raised
            renew.cancel()
            return subscription.result()
        held = list(self._held.values())
        for hook in self.on_drain:
            with contextlib.suppress(Exception):
                await hook()
        subscription.cancel()
        with contextlib.suppress(BaseException):
            await subscription
        try:
            await self._drain_runs(held)
        finally:
            renew.cancel()

    async def _drain_runs(self, held: list[str]) -> None:
        runtime, engine = self.runtime, self.runtime.engine
        began = engine.began()
        started = {r for r, b in began.items() if b}
        log.warning(
            "worker %s draining: no new runs; %d running get up to %.0f s, %d waiting go back",
            runtime.host,
            len(started),
            self.drain_seconds,
            len(held) + len(began) - len(started),
        )
        for run_id in held:
            await hand_back(runtime, run_id)
        deadline = time.monotonic() + self.drain_seconds
        while True:
            for run_id, b in engine.began().items():
                if not b:  # taken, waiting for a slot: another host will run it
                    await engine.stop(run_id)
                    if not await hand_back(runtime, run_id):  # it began meanwhile
                        await engine.stop(run_id, self._detail("before it began"))
            if not engine.executing() or self._now.is_set() or time.monotonic() >= deadline:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DRAIN_POLL_SECONDS):
                    await self._now.wait()
        left = engine.executing()
        if left:
            why = "at a second signal" if self._now.is_set() else "past the drain timeout"
            log.warning("worker %s: ending %d runs %s", runtime.host, len(left), why)
            detail = self._detail(
                f"at a second stop signal ({self.drain_seconds:.0f} s drain timeout)"
                if self._now.is_set()
                else f"the run outlived the drain timeout ({self.drain_seconds:.0f} s)"
            )
            await asyncio.gather(*(engine.stop(r, detail) for r in left))
        log.warning("worker %s drained", runtime.host)

    def _detail(self, why: str) -> str:
        return f"host {self.runtime.host} was stopped (drained): {why}"

    async def _renew(self) -> None:
        """Keep the leases of the runs claimed at receipt until the runtime takes them (and
        renews them itself). One the runtime has not taken ``TAKE_SECONDS`` after its token (its
        task run failed to start) is let go: disowned with its lease ended, it is settled by the
        next sweep of any process."""
        lease = self.runtime.settings.lease_seconds
        while True:
            await asyncio.sleep(lease / 3)
            taken = self.runtime.engine.executing()
            for run_id, token_at in list(self._claimed.items()):
                late = token_at is not None and time.monotonic() - token_at > TAKE_SECONDS
                if run_id in taken or late:
                    del self._claimed[run_id]
                if late and run_id not in taken:
                    with contextlib.suppress(Exception):
                        await self.runtime.store.leases.let_go(run_id, self.runtime.owner, utcnow())
            with contextlib.suppress(Exception):
                now = utcnow()
                await self.runtime.store.leases.renew(
                    list(self._claimed),
                    owner=self.runtime.owner,
                    renewed_at=now,
                    expires_at=now + _seconds(lease),
                )


def _seconds(value: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=value)


async def serve(settings: Settings, *, limit: int, total: int, sessions: int = 32) -> None:
    """Serve runs (and, over the internal channel, up to ``sessions`` sandbox sessions) until
    drained (a signal); the runtime closes (sandboxes torn down) after."""
    from ephemeral.cluster import sharing
    from ephemeral.sessions.host import SessionHost

    await sharing.check(settings)  # a records root or seal key of its own is refused here
    await ensure_limits(settings.host_id, limit, total)
    # recover=True: sandboxes left by this host's previous (killed) worker are reaped now.
    runtime = await Runtime.start(settings, warm_pool=settings.pool_size > 0, recover=True)
    await runtime.hold_leases(settings.lease_seconds)
    runtime.lease_expired_hooks.append(mark_crashed)
    host = await SessionHost.start(runtime, slots=sessions) if sessions else None
    freeze_startup_heap()
    worker = HostWorker(runtime, settings.drain_seconds, limit)
    if host is not None:  # a drain takes no new sessions either
        worker.on_drain.append(host.stop_taking)
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, worker.signal)
    redrive = asyncio.create_task(outbox.redrive_forever(runtime.store, create_task_run))
    pid_file = settings.state_dir / PID_FILE
    pid_file.write_text(this_process() + "\n")
    log.warning(
        "worker %s serving execute-run (limit %d) as task worker %s",
        settings.host_id,
        limit,
        worker.client_id,
    )
    try:
        await worker.astart()
    finally:
        redrive.cancel()
        with contextlib.suppress(BaseException):
            await redrive
        with contextlib.suppress(OSError):
            if pid_file.read_text().strip() == this_process():
                os.unlink(pid_file)
        if host is not None:
            await host.close()
        await runtime.close()
