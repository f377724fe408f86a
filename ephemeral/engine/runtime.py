"""The runtime of one host process: admission, control, the watchdog, recovery.

The CLI, the API server and the Prefect flows all go through one :class:`Runtime`, which each entry
point starts and hands to what needs it (nothing looks up "the process's runtime":
docs/architecture.md). It owns the store, the price book, the sandbox source
(``ephemeral.sandbox.source``), the run engine (``ephemeral.engine.engine``: how one run goes from
admission to its record, in this process) and the sandbox sessions. How a run is carried out once it
has a slot is its :class:`~ephemeral.engine.executor.Executor`, chosen by the entry point
(``ephemeral.flows.executor.executor_for``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from datetime import UTC, datetime, timedelta
from typing import Any

from ephemeral import errors, progress
from ephemeral.clock import SYSTEM, Clock
from ephemeral.cluster.leases import ProcessLease
from ephemeral.engine import exits
from ephemeral.engine.close import record
from ephemeral.engine.engine import EVENT_POLL_SECONDS, Engine
from ephemeral.engine.executor import Executor, PlainExecutor
from ephemeral.engine.exits import brief_error
from ephemeral.engine.grants import require_grants
from ephemeral.events import Event
from ephemeral.ids import new_run_id, utcnow
from ephemeral.lifecycle import (
    STARTED_STATUSES,
    TERMINAL_STATUSES,
    RunKind,
)
from ephemeral.models import NO_MODEL, resolve_model
from ephemeral.money.pricing import PriceBook
from ephemeral.oci import sandbox_image
from ephemeral.owner import is_alive, this_process
from ephemeral.policy import Policy, RunRequest
from ephemeral.providers.registry import provider_for
from ephemeral.sandbox import images
from ephemeral.sandbox.registry import get_driver, resolve_isolation
from ephemeral.sandbox.source import SandboxSource
from ephemeral.sessions.manager import Sessions
from ephemeral.settings import Settings
from ephemeral.store import RunRow, Store

__all__ = ["Runtime", "brief_error"]
log = logging.getLogger("ephemeral.engine.runtime")

CANCEL_POLL_SECONDS = 0.5  # how often a worker looks for cancel requests on its runs
WATCHDOG_SECONDS = 5.0  # how often the watchdog looks for runs that nothing is finishing
WATCHDOG_GRACE_SECONDS = 60.0  # past a run's time limit before the watchdog steps in
ISOLATION_LEVELS = ("microvm-kvm", "microvm-tcg", "gvisor", "namespaces")
LOCAL_ORG = "local"
LOCAL_ORG_CREDIT_MICROS = 100_000_000  # $100 of play money for the embedded CLI


def freeze_startup_heap() -> None:
    """For a long-lived process once its runtime has started: what starting loaded (modules,
    Prefect, schemas, the runtime) lives as long as the process, so the collector is told to
    leave it. Left to it, the first full collection re-scanned all of it and held every request
    of ``serve`` ~170 ms (measured; docs/deploy.md, "Seventh pass")."""
    gc.freeze()


class Runtime:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        price_book: PriceBook,
        executor: Executor | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.settings = settings
        self.store = store
        self.price_book = price_book
        self.executor: Executor = executor if executor is not None else PlainExecutor()
        self.owner = this_process()
        self.host = settings.host_id
        self.sandboxes = SandboxSource(settings)
        self.engine = Engine(settings, store, price_book, self.sandboxes, self.executor, self.owner)
        self.sessions = Sessions(settings, store, price_book, self.sandboxes, self.owner)
        self._admitting = 0
        self._suspects: set[str] = set()
        self.lease_expired_hooks: list[Callable[[str], Awaitable[None]]] = []
        self._watchdog: asyncio.Task[None] | None = None
        self._leases: asyncio.Task[None] | None = None
        self.process_lease: ProcessLease | None = None  # a worker's (renew_leases)
        # Runs a worker took from Prefect and keeps until their task body takes them into the
        # engine (flows.worker.HostWorker): nothing executes them yet, and that is not a fault.
        self.taken: Collection[str] = ()
        self.draining = False  # a draining worker takes no new runs (ephemeral.flows.worker)
        # The run watchdog's (its sweeps and the time limits it enforces): a test moves a fake
        # one; the sessions, leases and runs keep their own.
        self.clock = clock

    @property
    def dispatcher(self) -> Callable[[str], Awaitable[None]] | None:
        """Set when the executor hands runs to workers (``EPHEMERAL_EXECUTOR=dispatch``)."""
        return self.engine.dispatcher

    # lifecycle -----------------------------------------------------------------------------
    @classmethod
    async def start(
        cls,
        settings: Settings,
        *,
        executor: Executor | None = None,
        warm_pool: bool = False,
        recover: bool = True,
        watchdog: bool = True,
        clock: Clock = SYSTEM,
    ) -> Runtime:
        """Open the store, finish runs orphaned by a crash, start the warm pool and the watchdog.

        ``executor`` carries out each run (default:
        :class:`~ephemeral.engine.executor.PlainExecutor`), on this loop: ``ephemeral serve`` too
        admits, streams and executes on one loop.
        ``clock``: the watchdog's (``ephemeral.clock``).
        """
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        progress.stage("opening the store")
        store = await Store.open(settings.db_url)
        runtime = cls(settings, store, PriceBook.load(settings), executor, clock)
        if recover:
            await runtime.recover()
        if warm_pool and settings.pool_size > 0:
            await runtime.sandboxes.start_pool()
        if watchdog:
            runtime._watchdog = asyncio.create_task(runtime._watch(), name="run-watchdog")
            runtime._leases = asyncio.create_task(runtime._watch_runs(), name="run-leases")
        return runtime

    async def close(self) -> None:
        for loop_task in (self._watchdog, self._leases):
            if loop_task is not None:
                loop_task.cancel()
                with contextlib.suppress(BaseException):
                    await loop_task
        tasks = [t for r in self.engine.executing() if (t := self.engine.task(r)) is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.sessions.close()
        await self.executor.close()
        await self.sandboxes.close()
        await self.store.close()
        if self.process_lease is not None:
            await self.process_lease.stop()

    # admission -----------------------------------------------------------------------------
    async def local_org(self) -> str:
        org = await self.store.orgs.ensure(LOCAL_ORG, initial_credit_micros=LOCAL_ORG_CREDIT_MICROS)
        return org.id

    async def require_connections(self, org_id: str, policy: Policy) -> None:
        """The grant checks runs and sandbox sessions share (``engine.grants.require_grants``)."""
        await require_grants(self.store, org_id, policy, self.price_book, self.settings)

    async def admit(
        self,
        org_id: str,
        request: RunRequest,
        *,
        idempotency_key: str | None = None,
        body_hash: str | None = None,
        labels: dict[str, Any] | None = None,
    ) -> tuple[RunRow, bool]:
        """Validate, reserve the budget and record the run ``queued``; nothing runs yet."""
        model = resolve_model(request.model, self.settings, agent=request.agent is not None)
        if model != NO_MODEL:  # an agent run naming no model has none to serve or price
            try:
                provider_for(model, self.settings)
                self.price_book.check_model(model)
            except errors.UnknownModel as exc:
                raise errors.UnknownModel(
                    exc.detail, errors=[{"field": "model", "message": exc.detail}]
                ) from exc
        policy = request.policy()
        await self.require_connections(org_id, policy)
        # 422 naming `image` (or `agent.image`); a registry image's digest, which it boots
        image_hash = await self.sandboxes.require_image(policy)
        await self.sandboxes.require_isolation(policy.isolation, disk_mib=policy.disk_mib)
        row, replayed = await self.store.runs.admit(
            org_id=org_id,
            run_id=new_run_id(),
            model=model,
            # Under zero data retention the prompt lives only in this process's memory (or,
            # for a run another host executes, sealed in the store until that host takes it).
            prompt=None if policy.zero_data_retention else request.prompt,
            policy=policy.model_dump(mode="json"),
            # The request's own labels cannot use a reserved name, so the system's stay true.
            labels={**request.labels, **(labels or {})},
            idempotency_key=idempotency_key,
            body_hash=body_hash,
            # A dispatched run has no owner until a worker takes it: no process's death or
            # recovery may take it for an orphan while it waits in Prefect's queue.
            owner=None if self.dispatcher is not None else self.owner,
            image_hash=image_hash,
        )
        if not replayed and policy.zero_data_retention:
            await self.engine.custody.keep_prompt(
                row.id, request.prompt, elsewhere=self.dispatcher is not None
            )
        return row, replayed

    async def submit(self, org_id: str, request: RunRequest, **kw: Any) -> tuple[RunRow, bool]:
        """Admit and start in the background (the API's path).

        Refused with :class:`~ephemeral.errors.QueueFull` (429, before any money is reserved)
        when ``max_queued_runs`` runs already wait for an execution slot.
        """
        waiting = len(self.engine.executing()) + self._admitting - self.settings.max_concurrent_runs
        if waiting >= self.settings.max_queued_runs:
            slots = self.settings.max_concurrent_runs
            retry_after = self.engine.run_seconds * (waiting + 1) / slots
            raise errors.QueueFull(
                f"{max(0, waiting)} runs are already waiting for one of this host's {slots} "
                "execution slots; retry after the time in Retry-After",
                retry_after=min(60.0, max(1.0, retry_after)),
            )
        if self.dispatcher is not None:
            # Prefect's queue holds the waiting runs; the workers' own limits bound them.
            row, replayed = await self.admit(org_id, request, **kw)
            if not replayed:
                await self.engine.dispatch(row.id)
            return row, replayed
        self._admitting += 1
        try:
            row, replayed = await self.admit(org_id, request, **kw)
            if not replayed:
                self.engine.launch(row.id)
        finally:
            self._admitting -= 1
        return row, replayed

    # execution (the engine's; ephemeral/engine/engine.py walks one run) -------------------
    def launch(self, run_id: str) -> asyncio.Task[RunRow]:
        return self.engine.launch(run_id)

    async def execute(self, run_id: str) -> RunRow:
        """Run to the end in this process and return the settled row (``Engine.execute``)."""
        return await self.engine.execute(run_id)

    async def take(self, run_id: str) -> bool:
        return await self.engine.take(run_id)

    async def record(self, run_id: str) -> None:
        """Write the run's records again (an eval adds its verdicts after the close)."""
        await record(self.store, self.settings, run_id, rewrite=True)

    def take_zdr_output(self, run_id: str) -> str | None:
        """A zero-data-retention run's output held here, delivered once (engine/custody.py)."""
        return self.engine.custody.take_output(run_id)

    async def take_or_unseal_zdr_output(self, row: RunRow) -> str | None:
        """The output of a zero-data-retention run, for its first reader only: from this
        process's memory, or sealed in the store by the worker that ran it."""
        zdr = bool(row.policy.get("zero_data_retention"))
        return await self.engine.custody.take_or_unseal_output(row.id, zdr)

    # control -------------------------------------------------------------------------------
    async def cancel(self, run_id: str, org_id: str | None = None) -> RunRow:
        row = await self.store.runs.get(run_id, org_id)
        if row.status in TERMINAL_STATUSES:
            return row
        if row.kind == RunKind.SESSION and self.sessions.owns(run_id):
            return await self.sessions.end(run_id, org_id, cancelled=True)
        return await self.engine.cancel(row)

    async def wait(self, run_id: str, timeout: float | None = None) -> RunRow:
        return await self.engine.wait(run_id, timeout)

    async def events(
        self, run_id: str, after_seq: int = 0, *, follow: bool = False
    ) -> AsyncIterator[Event]:
        """The run's events after ``after_seq``; with ``follow``, until ``run.settled``."""
        seq = after_seq
        while True:
            batch = await self.store.events.list(run_id, after_seq=seq)
            for ev in batch:
                seq = ev.seq
                yield ev
                if ev.type == "run.settled":
                    return
            if not follow:
                return
            await asyncio.sleep(EVENT_POLL_SECONDS)

    # watchdog ------------------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await self.clock.sleep(WATCHDOG_SECONDS)
            try:
                await self.sweep()
            except Exception:
                log.exception("watchdog: sweep failed")

    async def sweep(self) -> list[str]:
        """Finish this process's runs that nothing is finishing; returns the ids it finished.

        A run with no live task on two sweeps in a row (one is not enough: a caller may admit
        and only then execute) ends ``crashed``. A run still ``provisioning`` or ``running`` past
        its time limit plus a grace ends ``timed_out``: its agent is stopped with that exit and
        closes the run (``Engine.end``).
        """
        finished: list[str] = []
        suspects: set[str] = set()
        now = self.clock.now()
        for row in await self.store.runs.open():
            if row.owner != self.owner or self.sessions.owns(row.id) or row.id in self.taken:
                continue  # a live session has its own watchdog (ephemeral.sessions.manager)
            task = self.engine.task(row.id)
            if task is None or task.done():
                if row.id not in self._suspects:
                    suspects.add(row.id)
                    continue
                exit = exits.crashed("nothing was executing the run (found by the watchdog)")
            elif row.started_at is not None and row.status in STARTED_STATUSES:
                limit = Policy.model_validate(row.policy).timeout_seconds + WATCHDOG_GRACE_SECONDS
                if (now - _aware(row.started_at)).total_seconds() <= limit:
                    continue
                exit = exits.timed_out("the run outlived its time limit (stopped by the watchdog)")
            else:
                continue
            log.error("run %s: %s", row.id, exit.detail)
            await self.engine.end(row.id, exit)
            finished.append(row.id)
        self._suspects = suspects
        finished += await self.settle_expired_leases()
        await self.store.sealed.purge(now)
        return finished

    async def settle_expired_leases(self) -> list[str]:
        """Settle runs whose executing host stopped renewing their lease (it died): failed,
        ``infra_error``, compute charged up to the last renewal. Safe from many processes."""
        finished = []
        for row in await self.store.leases.expired(utcnow()):
            if self.engine.task(row.id) is not None or self.sessions.owns(row.id):
                continue  # ours and alive: the renewal is merely late
            log.error("run %s: the lease of host %s expired", row.id, row.host)
            why = f"host {row.host} stopped renewing the run's lease (it died or lost the store)"
            await self.engine.end(row.id, exits.crashed(why))
            finished.append(row.id)
            if row.kind == RunKind.SESSION:
                continue  # the hooks are for runs' Prefect task runs: a session has none
            for hook in self.lease_expired_hooks:
                try:
                    await hook(row.id)
                except Exception:
                    log.exception("run %s: a lease-expiry hook failed", row.id)
        return finished

    # leases --------------------------------------------------------------------------------
    async def renew_leases(self, lease_seconds: float) -> None:
        """Make this runtime a worker: its slot grants take a lease, renewed every third of
        ``lease_seconds`` while the run executes here (by the run watcher), and this process
        holds a lease of its own until :meth:`close` (ephemeral.cluster.leases)."""
        if self.process_lease is None:
            self.process_lease = ProcessLease(
                self.settings.db_url, self.owner, self.host, lease_seconds
            )
            await self.process_lease.start()
        self.engine.lease_seconds = lease_seconds

    async def _watch_runs(self) -> None:
        """Every ``CANCEL_POLL_SECONDS``: act on cancel requests that any process wrote to the
        store for runs executing here, and (on a worker) renew their leases when due."""
        renewed = time.monotonic()
        cancelling: dict[str, asyncio.Task[RunRow]] = {}
        while True:
            await asyncio.sleep(CANCEL_POLL_SECONDS)
            try:
                mine = self.engine.executing()
                lease = self.engine.lease_seconds
                since = time.monotonic() - renewed
                if lease is not None and since >= lease / 3:
                    now = utcnow()
                    t0 = time.monotonic()
                    await self.store.leases.renew(
                        mine,
                        owner=self.owner,
                        renewed_at=now,
                        expires_at=now + timedelta(seconds=lease),
                    )
                    renewed = time.monotonic()
                    if since >= lease / 2 or renewed - t0 >= lease / 6:
                        log.warning(
                            "lease renewal late: %.2f s since the last one (due every %.2f s),"
                            " the store write took %.2f s, %d runs",
                            since,
                            lease / 3,
                            renewed - t0,
                            len(mine),
                        )
                for run_id in await self.store.cancels.requested(mine):
                    if self.engine.task(run_id) is not None and run_id not in cancelling:
                        cancelling[run_id] = asyncio.create_task(
                            self.cancel(run_id), name=f"cancel-{run_id}"
                        )
                for run_id, task in list(cancelling.items()):
                    if task.done():
                        del cancelling[run_id]
            except Exception:
                log.exception("run watcher: cancel poll or lease renewal failed")

    # recovery ------------------------------------------------------------------------------
    async def recover(self) -> list[str]:
        """Finish runs whose owning process died: reap their sandboxes, fail, settle, record
        (and record the settled runs a crash left unrecorded)."""
        from ephemeral.sandbox.reaper import reap

        orphans: list[RunRow] = []
        for row in await self.store.runs.open():
            if row.owner is None:
                continue  # dispatched, waiting in Prefect's queue for a worker to take it
            if is_alive(row.owner) is False and row.owner != self.owner:
                orphans.append(row)
        orphan_ids = {r.id for r in orphans}

        async def owner_alive(owner: str) -> bool:
            if owner in orphan_ids:
                return False
            try:
                row = await self.store.runs.get(owner)
            except errors.NotFound:
                return False
            return row.status not in TERMINAL_STATUSES and is_alive(row.owner) is not False

        await reap(self.settings, is_owner_alive=owner_alive)
        for row in orphans:
            await self.engine.end(row.id, exits.crashed("the process running this run died"))
        # Ended but never settled: only a crash inside an older version's multi-step close
        # leaves this (the close is one transaction now). Settle from what was charged.
        for row in await self.store.runs.unsettled():
            if is_alive(row.owner) is False and row.owner != self.owner:
                await self.engine.end(row.id, exits.crashed("unsettled"))
                orphan_ids.add(row.id)
        # Settled but never recorded: the process died between its close and its record.
        for row in await self.store.runs.unrecorded():
            if is_alive(row.owner) is False and row.owner != self.owner:
                await record(self.store, self.settings, row)
                orphan_ids.add(row.id)
        return sorted(orphan_ids)

    # introspection -------------------------------------------------------------------------
    def images(self) -> list[dict[str, Any]]:
        """The current build of every image built here (name, hash, size, built_at)."""
        from ephemeral.ids import rfc3339

        out = []
        for info in images.list_images(self.settings):
            if info.current:
                meta = sandbox_image.built_image(self.settings, info.name)
                out.append(
                    {
                        "name": info.name,
                        "hash": info.hash,
                        "size_bytes": info.size_bytes,
                        "built_at": rfc3339(datetime.fromtimestamp(info.built_at, UTC)),
                        "base": meta.base if meta else None,
                    }
                )
        return sorted(out, key=lambda i: i["name"])

    async def isolation_info(self) -> dict[str, Any]:
        """What this host offers (probed by really starting one) and what ``auto`` picks."""
        from ephemeral.sandbox.probe import level_report

        levels: dict[str, dict[str, Any]] = {}
        for level in ISOLATION_LEVELS:
            try:
                reason = await get_driver(level, self.settings).probe()
            except errors.EphemeralError as exc:
                reason = exc.detail
            levels[level] = await asyncio.to_thread(level_report, level, reason, self.settings)
        try:
            auto: str | None = await resolve_isolation("auto", self.settings)
        except errors.IsolationUnavailable:
            auto = None
        return {
            "available": [k for k, v in levels.items() if v["available"]],
            "auto": auto,
            "levels": levels,
        }


def _aware(at: datetime) -> datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)
