"""The run engine: one run, from admission to its record, in this process.

One run, top to bottom (``file:function`` for each stage; files under ``ephemeral/``, those
of this package by name)::

    admit     runtime.py:Runtime.admit              validate (model, connections, image,
                                                    isolation) → store/runs.py:Runs.admit: one
                                                    transaction: idempotency key, reserve
                                                    max_cost_micros on the org, run ``queued``
    launch    runtime.py:Runtime.submit             → engine.py:Engine.launch (a task per run), or
                                                    Engine.dispatch (a worker on some host runs it)
    slot      engine.py:Engine.execute              waits ``queued`` for one of
                                                    max_concurrent_runs slots, then hands a
                                                    RunHandle to the executor (executor.py;
                                                    flows/executor.py:executor_for picks it;
                                                    FlowExecutor.execute starts the agent-run
                                                    flow with it: flows/agent_run.py:RunId)
    grant     engine.py:EngineRunHandle.grant       ``queued → provisioning``: its clock starts
    build     engine.py:Engine.build                the run row (+ its zero-data-retention prompt)
                                                    → agent/loop.py:AgentRun
    steps     engine.py:EngineRunHandle.drive       → agent/loop.py:drive: provision → setup →
                                                    turn* → verify, then agent/loop.py:_finish
                                                    (shielded): teardown → settle; each a Steps
                                                    callable (plain methods, or Prefect tasks in
                                                    flows/agent_run.py)
      provision   agent/loop.py:AgentRun.provision  sandbox/source.py:SandboxSource.acquire (warm
                                                    pool or boot) → ``running`` + sandbox.ready,
                                                    files, egress, worker.started
      setup       agent/loop.py:AgentRun.setup      the request's setup commands
      turn        agent/loop.py:take_turn           AgentRun.model_step, then AgentRun.tool_step
                                                    for each tool call
      verify      agent/loop.py:AgentRun.verify     the request's verify commands
      teardown    agent/loop.py:AgentRun.teardown   destroy the sandbox, measure its compute
      settle      agent/loop.py:AgentRun.settle     a zero-data-retention output into custody,
                                                    then close.py:close (the ``settle`` task is
                                                    this method: tasks/run.py)
    close     close.py:close                        one transaction (store/runs.py:Runs.close):
                                                    compute charge + sandbox.destroyed, terminal
                                                    status, run.<status>, settlement, run.output,
                                                    run.settled, transcript
    record    close.py:record                       Parquet rows (record.py:record_run), then
                                                    store/runs.py:Runs.mark_recorded; a crash
                                                    between the close and the marker is repaired by
                                                    runtime.py:Runtime.recover

How a run ends is one of its exits (``engine/exits.py``: succeeded, failed, raised,
timed_out, budget_exhausted, cancelled, crashed), each a named transition to the same
:func:`~ephemeral.engine.close.close`. The agent loop takes its own
(``agent/loop.py:drive``); everything else ends a run through :meth:`Engine.end` with the exit
it names: a cancel (:meth:`Engine.cancel`: here, or the process that executes it is asked), the
watchdog (``timed_out`` past the time limit, ``crashed`` when nothing executes it), recovery
and expired leases (``crashed``), an executor that raised (``crashed``), a draining worker
(``cancelled`` with the drain as its detail; a run whose body never began is let go for another
host, :meth:`Engine.let_go`), Prefect's cancellation and crash hooks (``cancelled``,
``crashed``). ``end`` stops a live agent with the exit (the agent tears down and closes with
it); a run no agent closes is closed there, charging the compute its events show. A sandbox
session's exits are taken by its manager (``sessions/manager.py:Sessions``).

Everything one run holds in this process while it waits or executes (its task, its agent,
whether it holds a slot, the signal that its body began) is one :class:`RunState`; what a built
run holds (sandbox, budget, egress, the broker's context) is its :class:`~ephemeral.engine.run.Run`;
zero-data-retention prompts and outputs wait for their one reader in the engine's
:class:`~ephemeral.engine.custody.Custody`.
An executor sees a run only as a :class:`RunHandle` (``grant``, ``run``/``build``+``drive``,
``row``, ``done``, ``dispatch``, ``cancel``), never the runtime. One engine per process holds
every run it executes, on one event loop, behind one slot semaphore (``ephemeral serve`` with
Prefect included: its flow runs are awaited on the HTTP loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ephemeral import errors
from ephemeral.agent.loop import PLAIN_STEPS, AgentRun, Steps, drive
from ephemeral.broker import Broker
from ephemeral.broker import journal as charge_journal
from ephemeral.engine import exits
from ephemeral.engine.close import abandoned_compute, close
from ephemeral.engine.custody import Custody
from ephemeral.engine.executor import Dispatcher, Executor
from ephemeral.engine.exits import Exit, brief_error
from ephemeral.ids import utcnow
from ephemeral.lifecycle import OPEN_STATUSES, TERMINAL_STATUSES, RunStatus
from ephemeral.models import NO_MODEL, provider_of
from ephemeral.money.pricing import PriceBook
from ephemeral.owner import is_alive
from ephemeral.policy import Policy
from ephemeral.sandbox.source import SandboxSource
from ephemeral.settings import Settings
from ephemeral.store import RunRow, Store

log = logging.getLogger("ephemeral.engine.engine")

EVENT_POLL_SECONDS = 0.1
# How long a cancel waits for another process to end the run: its poll (0.5 s), the sandbox's
# destroy and the settle take about a second, several on a loaded host; then the API says 202.
CANCEL_WAIT_SECONDS = 10.0
# How long an exit waits for the run's agent to close it (teardown, settle) before the engine
# closes it itself from the run's events.
STOP_WAIT_SECONDS = 30.0


# one run's state ------------------------------------------------------------------------------
@dataclass
class RunState:
    """What this process holds for one run while it waits or executes here."""

    run_id: str
    task: asyncio.Task[RunRow] | None = None  # what executes it (cancel and the watchdog reach it)
    agent: AgentRun | None = None  # built, being driven
    granted: bool = False  # holds a slot; its executor has not built it yet
    started: asyncio.Event = field(default_factory=asyncio.Event)  # set when its build begins


class EngineRunHandle:
    """The engine's :class:`~ephemeral.engine.executor.RunHandle`: what an executor may do with
    one run."""

    def __init__(self, engine: Engine, state: RunState) -> None:
        self._engine = engine
        self._state = state
        self.run_id = state.run_id

    @property
    def started(self) -> asyncio.Event:
        """Set once the run's body began (its build): starting it again would repeat work."""
        return self._state.started

    def restart(self) -> None:
        """A fresh ``started`` signal, before another attempt to start the body."""
        self._state.started = asyncio.Event()

    async def grant(self) -> bool:
        """The run got a slot: ``queued → provisioning``, its time counts. False if it no
        longer waits (cancelled or abandoned meanwhile): do nothing then."""
        return await self._engine.grant(self.run_id)

    async def build(self) -> AgentRun | None:
        """The run's agent, or None when the run is not waiting to run here."""
        row = await self._engine.store.runs.get(self.run_id)
        waiting = row.status == RunStatus.QUEUED or self._state.granted
        if not waiting or row.reserved_micros <= 0:
            return None
        return await self._engine.build(self.run_id)

    async def drive(self, agent: AgentRun, steps: Steps = PLAIN_STEPS) -> RunRow:
        """Drive the built run through ``steps`` to its close and record (the ``agent-run``
        flow calls this with its task-wrapped steps)."""
        self._state.agent = agent  # cancel and stop reach the agent through its state
        try:
            # The settle step's close writes the record (once; ephemeral.engine.close).
            return await drive(agent, steps)
        finally:
            self._state.agent = None
            # Driven without the engine's execute (tests, a flow process): nothing else drops it.
            if self._state.task is None:
                self._engine._release(self.run_id, None)

    async def run(self, steps: Steps = PLAIN_STEPS) -> RunRow:
        """Build and drive: the whole body, for an executor that runs it on this loop."""
        agent = await self.build()
        if agent is None:
            return await self.row()
        return await self.drive(agent, steps)

    async def row(self) -> RunRow:
        """The run's row as stored now."""
        return await self._engine.store.runs.get(self.run_id)

    async def dispatch(self) -> None:
        """Hand the run to a worker (a dispatching runtime only)."""
        await self._engine.dispatch(self.run_id)

    async def done(self) -> RunRow:
        """Wait until whoever executes the run settled it; a zero-data-retention output
        sealed by that worker is taken into this process's custody for its one reader."""
        row = await self._engine.wait(self.run_id)
        if row.policy.get("zero_data_retention"):
            await self._engine.custody.receive(self.run_id)
        return row

    async def cancel(self) -> RunRow:
        row = await self._engine.store.runs.get(self.run_id)
        if row.status in TERMINAL_STATUSES:
            return row
        return await self._engine.cancel(row)


class Engine:
    """The runs of one process: their slots, states, build, drive, custody, cancel, close."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        price_book: PriceBook,
        sandboxes: SandboxSource,
        executor: Executor,
        owner: str,
    ) -> None:
        self.settings = settings
        self.store = store
        self.price_book = price_book
        self.sandboxes = sandboxes
        self.executor = executor
        self.owner = owner
        self.host = settings.host_id
        self.runs: dict[str, RunState] = {}
        # Zero-data-retention prompts and outputs; a worker's outputs are sealed for readers
        # in other processes.
        self.custody = Custody(settings, store, sealing=lambda: self.lease_seconds is not None)
        self.slots = asyncio.Semaphore(settings.max_concurrent_runs)
        self.run_seconds = 5.0  # moving average of a run's execution, for Retry-After
        # Scale-out (docs/deploy.md). A worker holds leases on the runs it executes; an API
        # process with a dispatcher hands admitted runs to Prefect instead of executing them.
        self.lease_seconds: float | None = None
        self.dispatcher: Callable[[str], Awaitable[None]] | None = (
            functools.partial(executor.dispatch, store)
            if isinstance(executor, Dispatcher)
            else None
        )

    # state --------------------------------------------------------------------------------
    def state(self, run_id: str) -> RunState:
        st = self.runs.get(run_id)
        if st is None:
            st = self.runs[run_id] = RunState(run_id)
        return st

    def handle(self, run_id: str) -> EngineRunHandle:
        return EngineRunHandle(self, self.state(run_id))

    def task(self, run_id: str) -> asyncio.Task[RunRow] | None:
        st = self.runs.get(run_id)
        return st.task if st is not None else None

    def executing(self) -> list[str]:
        """The runs a task of this process executes (or waits with for a slot)."""
        return [r for r, st in self.runs.items() if st.task is not None]

    def began(self) -> dict[str, bool]:
        """The runs of :meth:`executing`, each with whether its body began (a slot grant or its
        build): a draining worker hands back the others and lets these finish."""
        return {
            r: st.granted or st.started.is_set() or st.agent is not None
            for r, st in self.runs.items()
            if st.task is not None
        }

    def _release(self, run_id: str, task: asyncio.Task[Any] | None) -> None:
        st = self.runs.get(run_id)
        if st is None or task is None or st.task is task:
            self.custody.forget(run_id)  # a prompt it never built with goes with it
        if st is not None and (task is None or st.task is task):
            del self.runs[run_id]

    # execution ----------------------------------------------------------------------------
    def launch(self, run_id: str) -> asyncio.Task[RunRow]:
        task = asyncio.get_running_loop().create_task(self.execute(run_id), name=run_id)
        self.state(run_id).task = task
        task.add_done_callback(lambda t: self._release(run_id, t))
        return task

    async def execute(self, run_id: str) -> RunRow:
        """Run to the end in this process and return the settled row.

        The run waits ``queued`` for an execution slot with nothing but its reservation; the
        executor's grant marks it ``provisioning`` and starts its clock (``started_at``);
        the sandbox is attached only when its body provisions. Whatever goes wrong on this path,
        the run is settled before this returns (or, if even that fails, by the watchdog).
        """
        task = asyncio.current_task()
        st = self.state(run_id)
        if st.task is None:
            st.task = task  # so cancel and the watchdog can reach it
        t0 = time.monotonic()
        try:
            async with self.slots:
                t0 = time.monotonic()
                await self.executor.execute(EngineRunHandle(self, st))
            return await self.store.runs.get(run_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("run %s: execution failed: %s", run_id, brief_error(exc), exc_info=exc)
            try:
                await self.end(run_id, exits.crashed(exc))
            except Exception:
                # The store itself is failing; the watchdog retries once this task is gone.
                log.exception("run %s: could not settle after a failure", run_id)
            return await self.store.runs.get(run_id)
        finally:
            self.run_seconds = 0.9 * self.run_seconds + 0.1 * (time.monotonic() - t0)
            st.granted = False
            if task is not None and st.task is task:
                self._release(run_id, task)

    async def grant(self, run_id: str) -> bool:
        try:
            await self.store.runs.transition(
                run_id,
                expect={RunStatus.QUEUED},
                to=RunStatus.PROVISIONING,
                started_at=utcnow(),
                events=[("run.claimed", {"host": self.host})] if self.lease_seconds else (),
                **self.owner_fields(),
            )
        except errors.Conflict:  # cancelled or abandoned while it waited
            return False
        self.state(run_id).granted = True
        return True

    async def take(self, run_id: str) -> bool:
        """A worker takes a dispatched run as soon as Prefect hands it over, before it waits
        for a slot: the run stays ``queued`` (nothing is charged) but carries this host, this
        process as owner and a lease, so if the worker dies while the run waits, the run is
        settled like any other of a dead host. False if the run no longer waits."""
        task = asyncio.current_task()
        try:
            await self.store.runs.transition(
                run_id, expect={RunStatus.QUEUED}, to=RunStatus.QUEUED, **self.owner_fields()
            )
        except errors.Conflict:
            return False
        st = self.state(run_id)
        if st.task is None:
            st.task = task  # its lease is renewed, cancels reach it
        return True

    def owner_fields(self) -> dict[str, Any]:
        """What a slot grant (and a worker's take) writes besides the status: this host, this
        process as owner and (on a worker, whose runs other processes watch) a fresh lease."""
        fields: dict[str, Any] = {"host": self.host, "owner": self.owner}
        if self.lease_seconds is not None:
            now = utcnow()
            fields["lease_renewed_at"] = now
            fields["lease_expires_at"] = now + timedelta(seconds=self.lease_seconds)
        return fields

    async def build(self, run_id: str) -> AgentRun:
        st = self.state(run_id)
        st.granted = False
        st.started.set()
        row = await self.store.runs.get(run_id)
        policy = Policy.model_validate(row.policy)
        if policy.zero_data_retention:
            prompt = await self.custody.take_prompt(run_id)
            if prompt is None:
                raise errors.InvalidRequest(
                    "a zero-data-retention run can only execute in the process that admitted it"
                )
            row = row.model_copy(update={"prompt": prompt})
        if policy.agent is not None:  # its gateway grants the run's model beside `models`
            model = None if row.model == NO_MODEL else row.model
            policy = policy.model_copy(update={"models": policy.granted_models(model)})
        provider, provider_model = provider_of(row.model, self.settings)
        image = policy.run_image or self.settings.image
        # a registry image is the digest its admission recorded, whatever its name means now
        built = await self.sandboxes.admitted_image(image, row.image_hash)
        sandboxes = self.sandboxes
        return AgentRun(
            store=self.store,
            row=row,
            policy=policy,
            model=row.model,
            provider=provider,
            provider_model=provider_model,
            price_book=self.price_book,
            acquire_sandbox=lambda owner, limits: sandboxes.acquire(
                policy, owner, limits, row.image_hash
            ),
            limits=self.sandboxes.limits(policy.timeout_seconds, policy.disk_mib),
            max_turns=self.settings.max_turns,
            image=image,
            image_hash=built.hash if built else None,
            command_env=dict(built.env) if built else {},
            workdir=built.workdir if built else None,
            broker=Broker(self.settings),
            settings=self.settings,
            custody=self.custody,
        )

    async def dispatch(self, run_id: str) -> None:
        """Hand an admitted run to the dispatcher. If Prefect cannot take it now (a ``503``
        from its server under load, a timeout), the run stays ``queued`` and undispatched, and
        the outbox of every live API process and worker hands it over again
        (ephemeral.cluster.outbox): a transient error loses no run and fails no request."""
        assert self.dispatcher is not None
        try:
            await self.dispatcher(run_id)
        except Exception as exc:  # noqa: BLE001 - the outbox retries whatever went wrong
            log.warning(
                "run %s: handing it to Prefect failed (%s); the outbox hands it over again",
                run_id,
                brief_error(exc),
            )

    async def wait(self, run_id: str, timeout: float | None = None) -> RunRow:
        async with asyncio.timeout(timeout):
            while True:
                row = await self.store.runs.get(run_id)
                # Settled implies `run.settled` is written: the close is one transaction.
                if row.status in TERMINAL_STATUSES and row.settled:
                    return row
                await asyncio.sleep(EVENT_POLL_SECONDS)

    # exits (ephemeral.engine.exits) ---------------------------------------------------------
    async def cancel(self, row: RunRow) -> RunRow:
        """Cancel an open run (not a session): the ``cancelled`` exit, taken here when this
        process executes the run (or owns it and nothing executes it), else by the process
        that executes it."""
        run_id = row.id
        exit = exits.cancelled()
        st = self.runs.get(run_id)
        mine = st is not None and (st.agent is not None or st.task is not None)
        # A dispatching process executes no run: its runs are on workers, never here.
        if self.dispatcher is None and (mine or row.owner == self.owner):
            return await self.end(run_id, exit)
        # Still waiting for a worker: closed here (unless a worker claims it meanwhile).
        if row.status == RunStatus.QUEUED:
            row = await self.end(run_id, exit, expect={RunStatus.QUEUED})
            if row.status in TERMINAL_STATUSES:
                return row
        # Claimed by some process (any host): asked through the store, it acts within its
        # cancel poll; if it is dead, the run is ended here.
        await self.store.cancels.request(run_id)
        row = await self.store.runs.get(run_id)
        if row.status not in TERMINAL_STATUSES and is_alive(row.owner) is False:
            await self.end(run_id, exit)
        with contextlib.suppress(TimeoutError):
            return await self.wait(run_id, timeout=CANCEL_WAIT_SECONDS)
        return await self.store.runs.get(run_id)

    async def end(
        self,
        run_id: str,
        exit: Exit,
        *,
        expect: Collection[RunStatus] = OPEN_STATUSES,
        release: bool = False,
    ) -> RunRow:
        """End a run by ``exit`` (``ephemeral.engine.exits``): the one way the engine ends a run.

        A run whose agent this process drives is stopped, and the agent closes it with that
        exit (teardown, then the close); a task that only waits for a slot is cancelled. A run
        no agent closed (nothing drives it: it waited, its process died, its executor raised;
        or its agent did not finish within ``STOP_WAIT_SECONDS``) is closed here, charging the
        compute its events show, if it is still open in one of ``expect``: one in another
        status is left as it is (returned, as every row is). ``release``: the run leaves this
        process's runs at once (a draining worker's: no lease renewal, no cancel reaches it).

        Any number of processes may end the same run at once: the compute charge is idempotent
        on its ledger key and the close is a compare-and-set, so it ends once, by one exit.
        """
        st = self.runs.pop(run_id, None) if release else self.runs.get(run_id)
        agent = st.agent if st is not None else None
        task = st.task if st is not None else None
        if agent is not None:
            agent.stop_with(exit)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(BaseException):
                async with asyncio.timeout(STOP_WAIT_SECONDS):
                    await asyncio.shield(task)
        elif agent is not None:  # driven without a task of ours: it takes the exit at its next step
            return await self.store.runs.get(run_id)
        return await self._close(run_id, exit, expect)

    async def let_go(self, run_id: str) -> None:
        """Stop executing a run whose body never began, without ending it: its task cancelled
        and its state dropped (a draining worker hands it back to the queue)."""
        st = self.runs.pop(run_id, None)
        task = st.task if st is not None else None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def _close(self, run_id: str, exit: Exit, expect: Collection[RunStatus]) -> RunRow:
        """The close of a run no agent closes (:meth:`end`)."""
        # Egress charges made before the process died, not yet in the ledger (broker/journal).
        await charge_journal.replay(self.store, self.settings.state_dir, run_id)
        row = await self.store.runs.get(run_id)
        if row.settled or (row.status in OPEN_STATUSES and row.status not in expect):
            return row
        events = await self.store.events.list(run_id)
        limits = self.sandboxes.limits(Policy.model_validate(row.policy).timeout_seconds)
        compute = abandoned_compute(
            row,
            events,
            micros_per_second=self.sandboxes.compute_rate(limits, self.price_book),
            charged=await self.store.money.charged(run_id),
        )
        try:
            row = await close(
                self.store,
                self.settings,
                run_id,
                exit,
                usage=row.usage or {},
                output=row.output,
                compute=compute,
                expect=expect,
            )
        except errors.Conflict:  # it left `expect` meanwhile (a worker claimed it)
            return await self.store.runs.get(run_id)
        st = self.runs.get(run_id)
        if st is not None and st.task is None:
            del self.runs[run_id]
        return row
