"""The runtime of one host process: admission, execution, cancellation, live events, recovery.

The CLI, the API server and the Prefect flows all go through one :class:`Runtime`. It owns the
store, the price book, the sandbox pools and the set of runs executing in this process. How a
run is carried out once it has a slot is its :class:`~ephemeral.executor.Executor`, chosen by
the entry point (plain steps by default; the Prefect flow executor lives in ``ephemeral.flows``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from ephemeral import errors
from ephemeral.agent import PLAIN_STEPS, AgentRun, Steps, drive
from ephemeral.broker import Broker
from ephemeral.events import Event
from ephemeral.executor import Dispatcher, Executor, PlainExecutor
from ephemeral.ids import new_run_id, rfc3339, utcnow
from ephemeral.lifecycle import (
    OPEN_STATUSES,
    TERMINAL_STATUSES,
    RunStatus,
    TerminationReason,
    compute_charge,
)
from ephemeral.owner import is_alive, this_process
from ephemeral.policy import Policy, RunRequest
from ephemeral.pricing import PriceBook
from ephemeral.providers.registry import provider_for
from ephemeral.recording import record_run
from ephemeral.sandbox import images
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.sandbox.pool import boot_slots
from ephemeral.sandbox.registry import get_driver, resolve_isolation
from ephemeral.settings import Settings
from ephemeral.store import RunRow, Store

log = logging.getLogger("ephemeral.service")

EVENT_POLL_SECONDS = 0.1
CANCEL_POLL_SECONDS = 0.5  # how often a worker looks for cancel requests on its runs
# How long a cancel waits for another process to end the run: its poll (0.5 s), the sandbox's
# destroy and the settle take about a second, several on a loaded host; then the API says 202.
CANCEL_WAIT_SECONDS = 10.0
WATCHDOG_SECONDS = 5.0  # how often the watchdog looks for runs that nothing is finishing
WATCHDOG_GRACE_SECONDS = 60.0  # past a run's time limit before the watchdog steps in
ISOLATION_LEVELS = ("microvm-kvm", "microvm-tcg", "gvisor", "namespaces")
# What a request's isolation resolves to and which build an image name means are looked up on
# every admission and every sandbox (hashing the image definition, reading the probe cache and
# the image's metadata: ~10 ms of a session's create, measured); this long they are reused.
HOST_FACTS_SECONDS = 5.0
BOOT_ATTEMPTS = 3  # tries to boot a run's or a session's sandbox
BOOT_RETRY_SECONDS = 0.25
LOCAL_ORG = "local"
LOCAL_ORG_CREDIT_MICROS = 100_000_000  # $100 of play money for the embedded CLI

_by_loop: dict[asyncio.AbstractEventLoop, Runtime] = {}


def current() -> Runtime | None:
    """The runtime serving this event loop, if any (flows run by a worker start their own)."""
    try:
        return _by_loop.get(asyncio.get_running_loop())
    except RuntimeError:
        return None


class Runtime:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        price_book: PriceBook,
        executor: Executor | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.price_book = price_book
        self.executor: Executor = executor if executor is not None else PlainExecutor()
        self.owner = this_process()
        self._running: dict[str, asyncio.Task[RunRow]] = {}
        self._agents: dict[str, AgentRun] = {}
        self._slots = asyncio.Semaphore(settings.max_concurrent_runs)
        self._pools: dict[tuple[str, str], Any] = {}  # (isolation, image) -> WarmPool
        self._zdr_outputs: dict[str, str] = {}
        self._zdr_prompts: dict[str, str] = {}
        self._granted: set[str] = set()  # holds a slot; its executor has not built the run yet
        self._building: dict[str, asyncio.Event] = {}
        self._admitting = 0
        self._run_seconds = 5.0  # moving average of a run's execution, for Retry-After
        self._suspects: set[str] = set()
        self._host_facts: dict[tuple[str, str], tuple[float, Any]] = {}
        self._boots = asyncio.Semaphore(boot_slots())  # every sandbox this runtime starts
        self._watchdog: asyncio.Task[None] | None = None
        from ephemeral.sessions import Sessions

        self.sessions = Sessions(self)  # sandbox sessions live here (ephemeral.sessions)
        self.host = settings.host_id
        # Scale-out (docs/deploy.md). A worker holds leases on the runs it executes; an API
        # process with a dispatcher hands admitted runs to Prefect instead of executing them.
        self.lease_seconds: float | None = None
        self.dispatcher: Callable[[str], Awaitable[None]] | None = None
        self.lease_expired_hooks: list[Callable[[str], Awaitable[None]]] = []
        self._leases: asyncio.Task[None] | None = None

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
    ) -> Runtime:
        """Open the store, finish runs orphaned by a crash, start the warm pool and the watchdog.

        ``executor`` carries out each run (default: :class:`~ephemeral.executor.PlainExecutor`).
        Servers that run Prefect flows use :func:`ephemeral.flowloop.start_bridged` instead, so
        this loop stays free for admission and streaming.
        """
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        store = await Store.open(settings.db_url)
        runtime = cls(settings, store, PriceBook.load(settings), executor)
        if isinstance(executor, Dispatcher):
            runtime.dispatcher = executor.dispatch
        _by_loop[asyncio.get_running_loop()] = runtime
        if recover:
            await runtime.recover()
        if warm_pool and settings.pool_size > 0:
            await runtime._start_pool()
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
        for task in list(self._running.values()):
            task.cancel()
        for task in list(self._running.values()):
            with contextlib.suppress(BaseException):
                await task
        await self.sessions.close()
        await self.executor.close()
        for pool in self._pools.values():
            await pool.close()
        await self.store.close()
        for loop, runtime in list(_by_loop.items()):
            if runtime is self:
                del _by_loop[loop]

    async def isolation_for(self, requested: str) -> str:
        """The level ``requested`` resolves to here (``resolve_isolation``), reused for
        ``HOST_FACTS_SECONDS``; a level that cannot run raises every time."""
        hit = self._host_facts.get(("isolation", requested))
        if hit is not None and time.monotonic() - hit[0] < HOST_FACTS_SECONDS:
            return str(hit[1])
        level = await resolve_isolation(requested, self.settings)
        self._host_facts[("isolation", requested)] = (time.monotonic(), level)
        return level

    def built_image(self, name: str) -> images.ImageConfig | None:
        """The current build of image ``name`` (``images.built_image``), reused for
        ``HOST_FACTS_SECONDS``."""
        hit = self._host_facts.get(("image", name))
        if hit is not None and time.monotonic() - hit[0] < HOST_FACTS_SECONDS:
            return cast(images.ImageConfig | None, hit[1])
        built = images.built_image(self.settings, name)
        self._host_facts[("image", name)] = (time.monotonic(), built)
        return built

    async def _start_pool(self) -> None:
        from ephemeral.sandbox.pool import WarmPool

        isolation = await resolve_isolation(self.settings.isolation, self.settings)
        pool = WarmPool(
            get_driver(isolation, self.settings),
            self.settings.pool_size,
            self.default_limits(120),
            boots=self._boots,
        )
        await pool.start()
        # Per image: the pool holds sandboxes of the default image; a run naming another image
        # starts its sandbox cold (bench/images.py measures what that costs).
        self._pools[(isolation, self.settings.image)] = pool

    # admission -----------------------------------------------------------------------------
    async def local_org(self) -> str:
        org = await self.store.ensure_org(LOCAL_ORG, initial_credit_micros=LOCAL_ORG_CREDIT_MICROS)
        return org.id

    async def require_connections(self, org_id: str, policy: Policy) -> None:
        """A 422 naming ``connections[i].name`` when the org has no connection of that name
        (runs and sandbox sessions are admitted with the same check)."""
        names = [c.name for c in policy.connections]
        missing = await self.store.missing_connections(org_id, names)
        if missing:
            raise errors.InvalidRequest.field(
                f"connections[{names.index(missing[0])}].name",
                f"this org has no connection named {missing[0]!r} (ephemeral connections add)",
            )

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
        model = request.model or self.settings.default_model
        try:
            provider_for(model, self.settings)
            self.price_book.check_model(model)
        except errors.UnknownModel as exc:
            raise errors.UnknownModel(
                exc.detail, errors=[{"field": "model", "message": exc.detail}]
            ) from exc
        policy = request.policy()
        await self.require_connections(org_id, policy)
        if policy.image is not None:
            images.require_built(self.settings, policy.image)  # 422 naming `image`
        try:
            await self.isolation_for(policy.isolation)
        except errors.IsolationUnavailable as exc:
            raise errors.IsolationUnavailable(
                exc.detail, errors=[{"field": "isolation", "message": exc.detail}]
            ) from exc
        row, replayed = await self.store.admit_run(
            org_id=org_id,
            run_id=new_run_id(),
            model=model,
            # Under zero data retention the prompt lives only in this process's memory (or,
            # for a run another host executes, sealed in the store until that host takes it).
            prompt=None if policy.zero_data_retention else request.prompt,
            policy=policy.model_dump(mode="json"),
            labels=labels,
            idempotency_key=idempotency_key,
            body_hash=body_hash,
            # A dispatched run has no owner until a worker claims it: no process's death or
            # recovery may take it for an orphan while it waits in Prefect's queue.
            owner=None if self.dispatcher is not None else self.owner,
        )
        if not replayed and policy.zero_data_retention:
            if self.dispatcher is not None:
                await self.seal(row.id, "prompt", request.prompt)
            else:
                self.keep_prompt(row.id, request.prompt)
        return row, replayed

    async def seal(self, run_id: str, kind: str, text: str) -> None:
        """Keep zero-data-retention content for one reader in another process: sealed with
        the shared key, deleted at that read or after ``zdr_ttl_seconds``."""
        from ephemeral.broker.secrets import Sealer

        token = Sealer.for_settings(self.settings).seal({"text": text})
        expires = utcnow() + timedelta(seconds=self.settings.zdr_ttl_seconds)
        await self.store.put_sealed(run_id, kind, token, expires)

    async def unseal(self, run_id: str, kind: str) -> str | None:
        """Take sealed content out of the store: whoever calls first gets it, once."""
        from ephemeral.broker.secrets import Sealer

        token = await self.store.take_sealed(run_id, kind)
        if token is None:
            return None
        return Sealer.for_settings(self.settings).open(token).get("text")

    async def submit(self, org_id: str, request: RunRequest, **kw: Any) -> tuple[RunRow, bool]:
        """Admit and start in the background (the API's path).

        Refused with :class:`~ephemeral.errors.QueueFull` (429, before any money is reserved)
        when ``max_queued_runs`` runs already wait for an execution slot.
        """
        waiting = len(self._running) + self._admitting - self.settings.max_concurrent_runs
        if waiting >= self.settings.max_queued_runs:
            slots = self.settings.max_concurrent_runs
            retry_after = self._run_seconds * (waiting + 1) / slots
            raise errors.QueueFull(
                f"{max(0, waiting)} runs are already waiting for one of this host's {slots} "
                "execution slots; retry after the time in Retry-After",
                retry_after=min(60.0, max(1.0, retry_after)),
            )
        if self.dispatcher is not None:
            # Prefect's queue holds the waiting runs; the workers' own limits bound them.
            row, replayed = await self.admit(org_id, request, **kw)
            if not replayed:
                await self.dispatch(row.id)
            return row, replayed
        self._admitting += 1
        try:
            row, replayed = await self.admit(org_id, request, **kw)
            if not replayed:
                self.launch(row.id)
        finally:
            self._admitting -= 1
        return row, replayed

    async def dispatch(self, run_id: str) -> None:
        """Hand an admitted run to the dispatcher; if that fails the run ends ``infra_error``
        (its reservation refunded) and the error propagates."""
        assert self.dispatcher is not None
        try:
            await self.dispatcher(run_id)
        except Exception as exc:
            await self._fail(run_id, exc)
            raise errors.EphemeralError(
                f"could not hand the run to a worker: {brief_error(exc)}", cause=exc
            ) from exc

    def keep_prompt(self, run_id: str, prompt: str) -> None:
        """Hold a zero-data-retention prompt in memory for the runtime that will build the run."""
        self._zdr_prompts[run_id] = prompt

    def launch(self, run_id: str) -> asyncio.Task[RunRow]:
        task = asyncio.get_running_loop().create_task(self.execute(run_id), name=run_id)
        self._running[run_id] = task
        task.add_done_callback(lambda _t: self._running.pop(run_id, None))
        return task

    # execution -----------------------------------------------------------------------------
    def default_limits(self, timeout_seconds: int) -> Limits:
        return Limits(lifetime_seconds=float(timeout_seconds) + 10.0)

    def granted(self, run_id: str) -> bool:
        """The run holds an execution slot here and no agent was built for it yet."""
        return run_id in self._granted

    def build_signal(self, run_id: str) -> asyncio.Event:
        """An event set when :meth:`build` begins for the run: its executor learns that the
        run's body has started (before that, starting it again repeats nothing)."""
        event = self._building[run_id] = asyncio.Event()
        return event

    async def build(self, run_id: str) -> AgentRun:
        self._granted.discard(run_id)
        started = self._building.get(run_id)
        if started is not None:
            started.set()
        row = await self.store.get_run(run_id)
        policy = Policy.model_validate(row.policy)
        if policy.zero_data_retention:
            prompt = self._zdr_prompts.pop(run_id, None)
            if prompt is None:
                prompt = await self.unseal(run_id, "prompt")
            if prompt is None:
                raise errors.InvalidRequest(
                    "a zero-data-retention run can only execute in the process that admitted it"
                )
            row = row.model_copy(update={"prompt": prompt})
        provider, provider_model = provider_for(row.model, self.settings)
        image = policy.image or self.settings.image
        built = self.built_image(image)
        return AgentRun(
            store=self.store,
            row=row,
            policy=policy,
            model=row.model,
            provider=provider,
            provider_model=provider_model,
            price_book=self.price_book,
            acquire_sandbox=lambda owner, limits: self._acquire(policy, owner, limits),
            limits=self.default_limits(policy.timeout_seconds),
            max_turns=self.settings.max_turns,
            image=image,
            image_hash=built.hash if built else None,
            command_env=dict(built.env) if built else {},
            workdir=built.workdir if built else None,
            broker=Broker(self.settings),
        )

    async def _acquire(self, policy: Policy, owner: str, limits: Limits) -> Sandbox:
        """A sandbox for the run or session ``owner``: warm from the pool, else booted.

        A boot that fails is tried again (``BOOT_ATTEMPTS`` in all): nothing has happened in a
        sandbox that never started, and under a burst runsc now and then loses its own start
        handshake ("cannot read client sync file"), measured by bench/tti.py."""
        for attempt in range(1, BOOT_ATTEMPTS + 1):
            try:
                return await self._acquire_once(policy, owner, limits)
            except errors.SandboxError as exc:
                if attempt == BOOT_ATTEMPTS:
                    raise
                log.warning(
                    "%s: sandbox boot failed (attempt %d of %d): %s",
                    owner,
                    attempt,
                    BOOT_ATTEMPTS,
                    brief_error(exc),
                )
                await asyncio.sleep(BOOT_RETRY_SECONDS * attempt)
        raise AssertionError("unreachable")

    async def _acquire_once(self, policy: Policy, owner: str, limits: Limits) -> Sandbox:
        isolation = await self.isolation_for(policy.isolation)
        image = policy.image or self.settings.image
        pool = self._pools.get((isolation, image))
        if pool is not None:
            sandbox: Sandbox = await pool.acquire(owner, limits)
            return sandbox
        settings = self.settings
        if image != settings.image:
            settings = settings.model_copy(update={"image": image})
        async with self._boots:
            return await get_driver(isolation, settings).create(owner=owner, limits=limits)

    async def execute(self, run_id: str) -> RunRow:
        """Run to the end in this process and return the settled row.

        The run waits ``queued`` for an execution slot holding nothing but its reservation; the
        executor's :meth:`grant` marks it ``provisioning`` and starts its clock (``started_at``);
        the sandbox is attached only when its body provisions. Whatever goes wrong on this path,
        the run is settled before this returns (or, if even that fails, by the watchdog).
        """
        task = asyncio.current_task()
        if task is not None:
            self._running.setdefault(run_id, task)  # so cancel() and the watchdog can reach it
        t0 = time.monotonic()
        try:
            async with self._slots:
                t0 = time.monotonic()
                await self.executor.execute(self, run_id)
            return await self.store.get_run(run_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure must end the run, never leave it open
            await self._fail(run_id, exc)
            return await self.store.get_run(run_id)
        finally:
            self._run_seconds = 0.9 * self._run_seconds + 0.1 * (time.monotonic() - t0)
            self._granted.discard(run_id)
            self._building.pop(run_id, None)
            if task is not None and self._running.get(run_id) is task:
                del self._running[run_id]

    async def grant(self, run_id: str) -> bool:
        """The run got a slot: from now on its time counts. False if it no longer waits."""
        try:
            await self.store.transition(
                run_id,
                expect={RunStatus.QUEUED},
                to=RunStatus.PROVISIONING,
                started_at=utcnow(),
                events=[("run.claimed", {"host": self.host})] if self.lease_seconds else (),
                **self._claim_fields(),
            )
        except errors.Conflict:  # cancelled or abandoned while it waited
            return False
        self._granted.add(run_id)
        return True

    async def take(self, run_id: str) -> bool:
        """A worker takes a dispatched run as soon as Prefect hands it over, before it waits
        for a slot: the run stays ``queued`` (nothing is charged) but carries this host, this
        process as owner and a lease, so if the worker dies while the run waits, the run is
        settled like any other of a dead host. False if the run no longer waits."""
        task = asyncio.current_task()
        try:
            await self.store.transition(
                run_id, expect={RunStatus.QUEUED}, to=RunStatus.QUEUED, **self._claim_fields()
            )
        except errors.Conflict:
            return False
        if task is not None:
            self._running.setdefault(run_id, task)  # its lease is renewed, cancels reach it
        return True

    async def drop(self, run_id: str, exc: BaseException) -> None:
        """A taken run cannot execute here (no slot): end it ``infra_error``, let it go."""
        task = self._running.get(run_id)
        if task is asyncio.current_task():
            del self._running[run_id]
        await self._fail(run_id, exc)

    def _claim_fields(self) -> dict[str, Any]:
        """What a slot grant writes besides the status: this host, and (on a worker, whose
        runs other processes watch) this process as owner and a fresh lease."""
        fields: dict[str, Any] = {"host": self.host, "owner": self.owner}
        if self.lease_seconds is not None:
            now = utcnow()
            fields["lease_renewed_at"] = now
            fields["lease_expires_at"] = now + timedelta(seconds=self.lease_seconds)
        return fields

    async def _fail(self, run_id: str, exc: BaseException) -> None:
        """An exception escaped the execution path: end the run ``infra_error`` with the reason."""
        log.error("run %s: execution failed: %s", run_id, brief_error(exc), exc_info=exc)
        try:
            row = await self.store.get_run(run_id)
            if row.status not in TERMINAL_STATUSES or not row.settled:
                await self._abandon(
                    run_id, TerminationReason.INFRA_ERROR, f"execution failed: {brief_error(exc)}"
                )
        except Exception:
            # The store itself is failing; the watchdog retries once this task is gone.
            log.exception("run %s: could not settle after a failure", run_id)

    async def run_agent(
        self,
        agent: AgentRun,
        steps: Steps = PLAIN_STEPS,
        record: Callable[[str], Awaitable[None]] | None = None,
    ) -> RunRow:
        """Drive one built run; the ``agent-run`` flow calls this with its task-wrapped steps."""
        self._agents[agent.run_id] = agent
        try:
            row = await drive(agent, steps)
        finally:
            self._agents.pop(agent.run_id, None)
        if agent.zdr and agent.output is not None:
            if self.lease_seconds is not None:  # a worker: the reader is in another process
                await self.seal(agent.run_id, "output", agent.output)
            else:
                self._zdr_outputs[agent.run_id] = agent.output
        await (record or self.record)(row.id)
        return row

    async def record(self, run_id: str) -> None:
        row = await self.store.get_run(run_id)
        events = await self.store.list_events(run_id)
        await asyncio.to_thread(record_run, self.settings, row, events)

    def keep_zdr_output(self, run_id: str, output: str) -> None:
        """Hold a zero-data-retention output in memory for its one reader in this process."""
        self._zdr_outputs[run_id] = output

    def take_zdr_output(self, run_id: str) -> str | None:
        """A zero-data-retention run's output is delivered once, then forgotten."""
        return self._zdr_outputs.pop(run_id, None)

    async def claim_zdr_output(self, row: RunRow) -> str | None:
        """The output of a zero-data-retention run, for its first reader only: from this
        process's memory, or sealed in the store by the worker that ran it."""
        output = self.take_zdr_output(row.id)
        if output is None and row.policy.get("zero_data_retention"):
            output = await self.unseal(row.id, "output")
        return output

    # control -------------------------------------------------------------------------------
    async def cancel(self, run_id: str, org_id: str | None = None) -> RunRow:
        row = await self.store.get_run(run_id, org_id)
        if row.status in TERMINAL_STATUSES:
            return row
        if row.kind == "session" and self.sessions.owns(run_id):
            return await self.sessions.end(run_id, org_id, cancelled=True)
        if self.dispatcher is not None:  # its runs execute on workers, never here
            return await self._cancel_elsewhere(row)
        agent = self._agents.get(run_id)
        task = self._running.get(run_id)
        if agent is not None:
            agent.cancelled.set()
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        elif task is not None:  # admitted, waiting for a slot
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await self._abandon(run_id, TerminationReason.CANCELLED, "cancelled by request")
        elif row.owner == self.owner:
            await self._abandon(run_id, TerminationReason.CANCELLED, "cancelled by request")
        else:
            return await self._cancel_elsewhere(row)
        return await self.store.get_run(run_id)

    async def _cancel_elsewhere(self, row: RunRow) -> RunRow:
        """Cancel a run no task of this process executes: still waiting for a worker, it is
        closed here; claimed by some process (any host), that process is asked through the
        store and acts within ``CANCEL_POLL_SECONDS``; if that process is dead, here."""
        run_id = row.id
        if row.status == RunStatus.QUEUED:
            try:
                await self._abandon(
                    run_id,
                    TerminationReason.CANCELLED,
                    "cancelled by request",
                    expect={RunStatus.QUEUED},
                )
                return await self.store.get_run(run_id)
            except errors.Conflict:
                pass  # a worker claimed it meanwhile: ask that worker
        await self.store.request_cancel(run_id)
        row = await self.store.get_run(run_id)
        if row.status not in TERMINAL_STATUSES and is_alive(row.owner) is False:
            await self._abandon(run_id, TerminationReason.CANCELLED, "cancelled by request")
        with contextlib.suppress(TimeoutError):
            return await self.wait(run_id, timeout=CANCEL_WAIT_SECONDS)
        return await self.store.get_run(run_id)

    async def wait(self, run_id: str, timeout: float | None = None) -> RunRow:
        async with asyncio.timeout(timeout):
            while True:
                row = await self.store.get_run(run_id)
                # Settled implies `run.settled` is written: the close is one transaction.
                if row.status in TERMINAL_STATUSES and row.settled:
                    return row
                await asyncio.sleep(EVENT_POLL_SECONDS)

    async def events(
        self, run_id: str, after_seq: int = 0, *, follow: bool = False
    ) -> AsyncIterator[Event]:
        """The run's events after ``after_seq``; with ``follow``, until ``run.settled``."""
        seq = after_seq
        while True:
            batch = await self.store.list_events(run_id, after_seq=seq)
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
            await asyncio.sleep(WATCHDOG_SECONDS)
            try:
                await self.sweep()
            except Exception:
                log.exception("watchdog: sweep failed")

    async def sweep(self) -> list[str]:
        """Finish this process's runs that nothing is finishing; returns the ids it finished.

        A run with no live task on two sweeps in a row (one is not enough: a caller may admit
        and only then execute) is abandoned ``infra_error``. A run still ``provisioning`` or
        ``running`` past its time limit plus a grace is stopped and then abandoned.
        """
        finished: list[str] = []
        suspects: set[str] = set()
        now = utcnow()
        for row in await self.store.open_runs():
            if row.owner != self.owner or self.sessions.owns(row.id):
                continue  # a live session has its own watchdog (ephemeral.sessions)
            task = self._running.get(row.id)
            if task is None or task.done():
                if row.id not in self._suspects:
                    suspects.add(row.id)
                    continue
                detail = "nothing was executing the run (found by the watchdog)"
            elif row.started_at is not None and row.status in ("provisioning", "running"):
                limit = Policy.model_validate(row.policy).timeout_seconds + WATCHDOG_GRACE_SECONDS
                if (now - _aware(row.started_at)).total_seconds() <= limit:
                    continue
                await self._stop(row.id, task)
                detail = "the run outlived its time limit (stopped by the watchdog)"
            else:
                continue
            if (await self.store.get_run(row.id)).status not in TERMINAL_STATUSES:
                log.error("run %s: %s", row.id, detail)
                await self._abandon(row.id, TerminationReason.INFRA_ERROR, detail)
            finished.append(row.id)
        self._suspects = suspects
        finished += await self.settle_expired_leases()
        await self.store.purge_sealed(now)
        return finished

    async def settle_expired_leases(self) -> list[str]:
        """Settle runs whose executing host stopped renewing their lease (it died): failed,
        ``infra_error``, compute charged up to the last renewal. Safe from many processes."""
        finished = []
        for row in await self.store.expired_leases(utcnow()):
            if row.id in self._running or self.sessions.owns(row.id):
                continue  # ours and alive: the renewal is merely late
            log.error("run %s: the lease of host %s expired", row.id, row.host)
            try:
                await self._abandon(
                    row.id,
                    TerminationReason.INFRA_ERROR,
                    f"host {row.host} stopped renewing the run's lease (it died or lost the store)",
                )
            except errors.Conflict:
                continue
            finished.append(row.id)
            if row.kind == "session":
                continue  # the hooks are for runs' Prefect task runs: a session has none
            for hook in self.lease_expired_hooks:
                try:
                    await hook(row.id)
                except Exception:
                    log.exception("run %s: a lease-expiry hook failed", row.id)
        return finished

    # leases --------------------------------------------------------------------------------
    def hold_leases(self, lease_seconds: float) -> None:
        """Make this runtime a worker: its slot grants take a lease, renewed every third of
        ``lease_seconds`` while the run executes here (by the run watcher)."""
        self.lease_seconds = lease_seconds

    async def _watch_runs(self) -> None:
        """Every ``CANCEL_POLL_SECONDS``: act on cancel requests that any process wrote to the
        store for runs executing here, and (on a worker) renew their leases when due."""
        renewed = time.monotonic()
        cancelling: dict[str, asyncio.Task[RunRow]] = {}
        while True:
            await asyncio.sleep(CANCEL_POLL_SECONDS)
            try:
                mine = list(self._running)
                lease = self.lease_seconds
                if lease is not None and time.monotonic() - renewed >= lease / 3:
                    now = utcnow()
                    await self.store.renew_leases(
                        mine, renewed_at=now, expires_at=now + timedelta(seconds=lease)
                    )
                    renewed = time.monotonic()
                for run_id in await self.store.cancel_requested(mine):
                    if run_id in self._running and run_id not in cancelling:
                        cancelling[run_id] = asyncio.create_task(
                            self.cancel(run_id), name=f"cancel-{run_id}"
                        )
                for run_id, task in list(cancelling.items()):
                    if task.done():
                        del cancelling[run_id]
            except Exception:
                log.exception("run watcher: cancel poll or lease renewal failed")

    async def _stop(self, run_id: str, task: asyncio.Task[RunRow]) -> None:
        task.cancel()
        with contextlib.suppress(BaseException):
            async with asyncio.timeout(30):
                await asyncio.shield(task)

    # recovery ------------------------------------------------------------------------------
    async def recover(self) -> list[str]:
        """Finish runs whose owning process died: reap their sandboxes, fail, settle, record."""
        from ephemeral.sandbox.reaper import reap

        orphans: list[RunRow] = []
        for row in await self.store.open_runs():
            if row.owner is None:
                continue  # dispatched, waiting in Prefect's queue for a worker to claim it
            if is_alive(row.owner) is False and row.owner != self.owner:
                orphans.append(row)
        orphan_ids = {r.id for r in orphans}

        async def owner_alive(owner: str) -> bool:
            if owner in orphan_ids:
                return False
            try:
                row = await self.store.get_run(owner)
            except errors.NotFound:
                return False
            return row.status not in TERMINAL_STATUSES and is_alive(row.owner) is not False

        await reap(self.settings, is_owner_alive=owner_alive)
        for row in orphans:
            await self._abandon(
                row.id, TerminationReason.INFRA_ERROR, "the process running this run died"
            )
        # Ended but never settled: only a crash inside an older version's multi-step close
        # leaves this (the close is one transaction now). Settle from what was charged.
        for row in await self.store.unsettled_runs():
            if is_alive(row.owner) is False and row.owner != self.owner:
                await self._abandon(row.id, TerminationReason.INFRA_ERROR, "unsettled")
                orphan_ids.add(row.id)
        return sorted(orphan_ids)

    async def finish_orphan(self, run_id: str, reason: TerminationReason | str) -> None:
        """Close a run whose process is gone (Prefect cancellation/crash hooks call this)."""
        from ephemeral.sandbox.reaper import reap

        row = await self.store.get_run(run_id)
        if row.status in TERMINAL_STATUSES:
            return

        async def alive(owner: str) -> bool:
            return owner != run_id

        await reap(self.settings, is_owner_alive=alive)
        reason = TerminationReason(reason)
        cancelled = reason is TerminationReason.CANCELLED
        detail = "cancelled by request" if cancelled else "the run's process died"
        await self._abandon(run_id, reason, detail)

    async def _abandon(
        self,
        run_id: str,
        reason: TerminationReason,
        detail: str,
        *,
        expect: Collection[RunStatus] = OPEN_STATUSES,
    ) -> None:
        """Close a run that has no live agent: charge compute it used, settle, record.

        Any number of processes may abandon the same run at once: the compute charge is
        idempotent on its ledger key and the close is a compare-and-set, so it settles once.
        """
        row = await self.store.get_run(run_id)
        events = await self.store.list_events(run_id)
        types = [e.type for e in events]
        if "sandbox.ready" in types and "sandbox.destroyed" not in types:
            # The agent's own clock died with it: the sandbox lived from its ready event to the
            # last thing the run recorded, or to the last lease renewal of its host.
            ready = next(e for e in events if e.type == "sandbox.ready")
            end = events[-1].at
            if row.lease_renewed_at is not None:
                end = max(end, rfc3339(row.lease_renewed_at), key=_parse_at)
            lifetime = _ms_between(ready.at, end)
            policy = Policy.model_validate(row.policy)
            limits = self.default_limits(policy.timeout_seconds)
            charged = await self.store.charged(run_id)
            compute = compute_charge(
                micros_per_second=self.price_book.compute_micros(
                    vcpu_seconds=limits.cpus, gib_seconds=limits.memory_mib / 1024
                ),
                seconds=lifetime / 1000,
                reserved_micros=row.reserved_micros,
                other_spent_micros=sum(charged.values()) - charged.get("compute_micros", 0),
            )
            await self.store.charge(
                run_id,
                "compute",
                compute,
                key=f"{run_id}:compute",
                event=("sandbox.destroyed", {"lifetime_ms": lifetime}),
            )
        await self.store.close_run(
            run_id,
            reason=reason,
            detail=detail,
            usage=row.usage or {},
            output=row.output,
            expect=expect,
        )
        await self.record(run_id)

    # introspection -------------------------------------------------------------------------
    def images(self) -> list[dict[str, Any]]:
        """The current build of every image built here (name, hash, size, built_at)."""
        from ephemeral.ids import rfc3339

        out = []
        for info in images.list_images(self.settings):
            if info.current:
                meta = images.built_image(self.settings, info.name)
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


def _parse_at(at: str) -> datetime:
    return datetime.fromisoformat(at.replace("Z", "+00:00"))


def _ms_between(a: str, b: str) -> int:
    return max(0, int((_parse_at(b) - _parse_at(a)).total_seconds() * 1000))


def _aware(at: datetime) -> datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def brief_error(exc: BaseException) -> str:
    """The exception's type and first line, bounded: it lands in the run's termination detail."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__
