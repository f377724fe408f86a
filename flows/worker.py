"""``ephemeral worker``: one host's share of a scale-out deployment (docs/deploy.md).

One process per host: a Prefect task worker serving ``execute-run``, with this host's runtime
on the same event loop (its warm pool, its leases and cancel watch, its watchdog, and the
reaper that ran at start), and the admission outbox (ephemeral.cluster.outbox). Before serving it
makes sure the global concurrency limits exist: ``microvm:<host>`` at ``--limit`` (created or
updated) and ``microvm-total`` (created if missing; an operator sets its real value).

**Drain.** SIGTERM, SIGINT or ``ephemeral worker --drain`` (a SIGTERM to the pid in
``<state dir>/worker.pid``) stops the subscription, so Prefect hands this host no more runs.
Runs the host has taken but not started go back to the queue at once under a fresh task run
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

from prefect.client.schemas.objects import TaskRun
from prefect.client.subscriptions import Subscription
from prefect.settings import get_current_settings
from prefect.task_worker import TaskWorker

from ephemeral.cluster import outbox
from ephemeral.engine import exits
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
from ephemeral.lifecycle import STARTED_STATUSES
from ephemeral.owner import this_process
from ephemeral.settings import Settings

log = logging.getLogger("ephemeral.flows.worker")

PID_FILE = "worker.pid"
DRAIN_POLL_SECONDS = 0.2
SCHEDULED_PATH = "/task_runs/subscriptions/scheduled"  # Prefect's websocket of task runs to run
TAKE_SECONDS = 60.0  # from a taken run's slot to the runtime's take, at most (seconds, loaded)


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


class HostWorker:
    """This host's task worker, on Prefect's public API: Prefect's ``TaskWorker`` executes each
    task run (``execute_task_run``), this class receives them (``Subscription``, the websocket
    Prefect's worker uses), keeps to the limit, takes a run received at the limit, and drains.

    A subscription hands over (and acknowledges) the next task run before anything waits for
    a free slot, so at its limit the worker has one run Prefect will not give anyone else.
    That run is taken here (``queued``, this host, a lease renewed by :meth:`_renew`): if the
    worker dies it is settled through its lease, and a drain hands it back. Prefect's own
    worker keeps its limit inside (a private limiter and receive loop, which this class once
    overrode); here its limit is off and the limit is :attr:`slots`.
    """

    def __init__(self, runtime: Runtime, drain_seconds: float, limit: int) -> None:
        self.prefect = TaskWorker(execute_run_task(runtime), limit=None)
        self.runtime = runtime
        self.drain_seconds = drain_seconds
        self.slots = asyncio.Semaphore(limit)
        self.signals = 0
        self._drain = asyncio.Event()
        self._now = asyncio.Event()
        self._waiting: dict[UUID, str] = {}  # task run id -> run id, taken, waiting for a slot
        # run id -> when its slot came: renewed here until the engine took it (its parameters
        # are read and Prefect's engine starts in between: seconds on a loaded host)
        self._taken: dict[str, float | None] = {}
        runtime.taken = self._taken  # so its watchdog does not end them as unexecuted
        self._executing: set[asyncio.Task[None]] = set()  # one per task run given a slot
        self.on_drain: list[Callable[[], Awaitable[None]]] = []  # run as the drain begins

    @property
    def client_id(self) -> str:
        return self.prefect.client_id

    def signal(self) -> None:
        """SIGTERM/SIGINT: the first drains, a second ends the rest now."""
        self.runtime.draining = True
        self.signals += 1
        (self._drain if self.signals == 1 else self._now).set()

    async def serve(self) -> None:
        """Receive and execute task runs until drained (or the subscription fails: raised)."""
        async with self.prefect:  # its Prefect client and thread pool, for execute_task_run
            receiving = asyncio.ensure_future(self._receive())
            drain = asyncio.ensure_future(self._drain.wait())
            renew = asyncio.ensure_future(self._renew())
            try:
                await asyncio.wait({receiving, drain}, return_when=asyncio.FIRST_COMPLETED)
                if receiving.done():  # it ended by itself (an error): no drain, it is raised
                    for running in self._executing:
                        running.cancel()
                    receiving.result()
                    return
                waiting = list(self._waiting.values())
                for hook in self.on_drain:
                    with contextlib.suppress(Exception):
                        await hook()
                receiving.cancel()
                with contextlib.suppress(BaseException):
                    await receiving
                await self._drain_runs(waiting)
            finally:
                for loop_task in (drain, receiving, renew):
                    loop_task.cancel()
                # Each task run reports its end to Prefect before Prefect's client closes.
                await asyncio.gather(*self._executing, return_exceptions=True)

    async def _receive(self) -> None:
        api = get_current_settings().api.url
        if api is None:
            raise RuntimeError("`ephemeral worker` needs PREFECT_API_URL (a Prefect server)")
        subscription = Subscription(
            model=TaskRun,
            path=SCHEDULED_PATH,
            keys=self.prefect.task_keys,
            client_id=self.prefect.client_id,
            base_url=api,
        )
        async for task_run in subscription:
            if self.slots.locked():  # at the limit: the run waits here, taken
                try:
                    await self._take(task_run)
                except Exception:  # untaken it is still served when a slot frees
                    log.exception("task run %s: could not take the run it carries", task_run.id)
            try:
                await self.slots.acquire()
            finally:
                run_id = self._waiting.pop(task_run.id, None)
                if run_id is not None:
                    self._taken[run_id] = time.monotonic()
            executing = asyncio.create_task(self._execute(task_run), name=f"task-{task_run.name}")
            self._executing.add(executing)
            executing.add_done_callback(self._executing.discard)

    async def _execute(self, task_run: TaskRun) -> None:
        try:
            await self.prefect.execute_task_run(task_run)
        finally:
            self.slots.release()

    async def _take(self, task_run: TaskRun) -> None:
        run_id = task_run.name  # named for its run (create_task_run)
        self._waiting[task_run.id] = run_id
        self._taken[run_id] = None
        now = utcnow()
        await self.runtime.store.outbox.take(
            run_id,
            host=self.runtime.host,
            owner=self.runtime.owner,
            renewed_at=now,
            expires_at=now + _seconds(self.runtime.settings.lease_seconds),
        )

    async def _drain_runs(self, waiting: list[str]) -> None:
        runtime, engine = self.runtime, self.runtime.engine
        began = engine.began()
        started = {r for r, b in began.items() if b}
        log.warning(
            "worker %s draining: no new runs; %d running get up to %.0f s, %d waiting go back",
            runtime.host,
            len(started),
            self.drain_seconds,
            len(waiting) + len(began) - len(started),
        )
        for run_id in waiting:
            await hand_back(runtime, run_id)
        deadline = time.monotonic() + self.drain_seconds
        while True:
            for run_id, b in engine.began().items():
                if not b:  # taken, waiting for a slot: another host will run it
                    await engine.let_go(run_id)
                    if not await hand_back(runtime, run_id):  # it began meanwhile
                        await self._end(run_id, "before it began")
            if not engine.executing() or self._now.is_set() or time.monotonic() >= deadline:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DRAIN_POLL_SECONDS):
                    await self._now.wait()
        left = engine.executing()
        if left:
            why = "at a second signal" if self._now.is_set() else "past the drain timeout"
            log.warning("worker %s: ending %d runs %s", runtime.host, len(left), why)
            why = (
                f"at a second stop signal ({self.drain_seconds:.0f} s drain timeout)"
                if self._now.is_set()
                else f"the run outlived the drain timeout ({self.drain_seconds:.0f} s)"
            )
            await asyncio.gather(*(self._end(r, why) for r in left))
        log.warning("worker %s drained", runtime.host)

    async def _end(self, run_id: str, why: str) -> None:
        """A run that began here ends ``cancelled`` by the drain (one still queued is left to
        the queue: its task is let go)."""
        detail = f"host {self.runtime.host} was stopped (drained): {why}"
        await self.runtime.engine.end(
            run_id, exits.cancelled(detail), expect=STARTED_STATUSES, release=True
        )

    async def _renew(self) -> None:
        """Keep the leases of the runs taken at receipt until the engine takes them (and
        renews them itself). One the engine has not taken ``TAKE_SECONDS`` after its slot (its
        task run failed to start) is let go: disowned with its lease ended, it is settled by the
        next sweep of any process."""
        lease = self.runtime.settings.lease_seconds
        while True:
            await asyncio.sleep(lease / 3)
            executing = self.runtime.engine.executing()
            for run_id, slot_at in list(self._taken.items()):
                late = slot_at is not None and time.monotonic() - slot_at > TAKE_SECONDS
                if run_id in executing or late:
                    del self._taken[run_id]
                if late and run_id not in executing:
                    with contextlib.suppress(Exception):
                        await self.runtime.store.leases.let_go(run_id, self.runtime.owner, utcnow())
            with contextlib.suppress(Exception):
                now = utcnow()
                await self.runtime.store.leases.renew(
                    list(self._taken),
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
    await runtime.renew_leases(settings.lease_seconds)
    runtime.lease_expired_hooks.append(mark_crashed)
    host = await SessionHost.start(runtime, slots=sessions) if sessions else None
    freeze_startup_heap()
    worker = HostWorker(runtime, settings.drain_seconds, limit)
    if host is not None:  # a drain takes no new sessions either
        worker.on_drain.append(host.stop_taking)
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, worker.signal)
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
        await worker.serve()
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
