"""One run in this process, whoever drives it: our agent loop or a client.

An agent run (:class:`ephemeral.agent.loop.AgentRun`) and a sandbox session
(:class:`ephemeral.sessions.manager.Live`) are each a :class:`Run` plus their driver: the agent
loop's model and tool steps, or a client's execs. What every run has is here, once:

- its row, policy and store; its sandbox, and the transition that records it ``running`` with
  ``sandbox.ready`` (isolation, runtime, sandbox id, image and image hash on the row);
- its budget inside the reservation (:class:`~ephemeral.money.budget.RunBudget`) and its web charges
  (:class:`~ephemeral.broker.attach.WebCharges`);
- its deadline and the time it has left, read on the clock seam (``ephemeral.clock``);
- the egress proxy and the variables its commands reach it through;
- the broker's context (:class:`~ephemeral.broker.context.BrokerContext`): events (redacted
  when the run keeps zero data), web charges, the org's connections, egress's stop.

How the run ends (its close, ``ephemeral.engine.close``) stays with its driver's exits.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ephemeral.broker.attach import WebCharges, cut_egress, egress_stop, start_egress
from ephemeral.clock import SYSTEM, Clock
from ephemeral.events import redact_for_zdr
from ephemeral.lifecycle import RunStatus, StopRun
from ephemeral.money.budget import RunBudget

if TYPE_CHECKING:
    from ephemeral.broker import Broker
    from ephemeral.broker.egress import Egress
    from ephemeral.engine.custody import Custody
    from ephemeral.money.pricing import PriceBook
    from ephemeral.policy import Policy
    from ephemeral.sandbox.base import Limits, Sandbox
    from ephemeral.store import RunRow, Store
    from ephemeral.store.connections import StoredConnection


@dataclass(kw_only=True)
class Run:
    """What every run holds while it runs here; the broker's context for its egress."""

    store: Store
    row: RunRow
    policy: Policy
    price_book: PriceBook
    limits: Limits  # its sandbox's; compute is priced by them
    broker: Broker | None = None  # serves web, connections and models (ephemeral.broker)
    clock: Clock = SYSTEM
    image_hash: str | None = None  # the hash of the image its sandbox boots (None: unknown)
    sandbox: Sandbox | None = None
    egress: Egress | None = None  # the sandbox's proxy, when web or connections are granted
    egress_env: dict[str, str] = field(default_factory=dict)  # proxy variables for commands
    # Holds a zero-data-retention output for its one reader (the engine's, set at the build).
    custody: Custody | None = None
    _delivered: bool = field(default=False, init=False)
    budget: RunBudget = field(init=False)
    web: WebCharges = field(init=False)  # the web charges (ephemeral.broker.attach)
    deadline: float = field(init=False)  # clock.monotonic(): the run's whole time limit
    # What its driver has of it: the deadline less verify's slice (a session has no verify).
    work_deadline: float = field(init=False)

    def __post_init__(self) -> None:
        rate = self.price_book.compute_micros(
            vcpu_seconds=self.limits.cpus, gib_seconds=self.limits.memory_mib / 1024
        )
        self.budget = RunBudget(
            reserved_micros=self.row.reserved_micros,
            compute_micros_per_second=float(rate),
            clock=self.clock,
        )
        self.deadline = self.clock.monotonic() + self.policy.timeout_seconds
        self.work_deadline = self.deadline - self.policy.verify_reserve_seconds()
        journal = self.broker.settings.state_dir if self.broker is not None else None
        self.web = WebCharges(self.store, self.row.id, self.budget, self.price_book, journal)

    @property
    def run_id(self) -> str:
        return self.row.id

    @property
    def org_id(self) -> str:
        return self.row.org_id

    @property
    def zdr(self) -> bool:
        return self.policy.zero_data_retention

    # the sandbox -------------------------------------------------------------------------
    def attach(self, sandbox: Sandbox) -> None:
        """The sandbox is the run's from now: its compute counts from here."""
        self.sandbox = sandbox
        self.budget.sandbox_started = self.clock.monotonic()

    async def running(
        self,
        sandbox: Sandbox,
        *,
        boot_ms: int,
        queue_wait_ms: int,
        expect: Collection[RunStatus],
        then: Sequence[tuple[str, dict[str, Any]]] = (),
        **fields: Any,
    ) -> RunRow:
        """``→ running`` with ``sandbox.ready`` (and the events ``then``, in one transaction):
        the row records the sandbox, its isolation and runtime, its image and image hash."""
        ready = {
            "isolation": sandbox.isolation,
            "image": sandbox.image,
            "image_hash": self.image_hash,
            "boot_ms": boot_ms,
            "queue_wait_ms": queue_wait_ms,
            "runtime": sandbox.runtime,
        }
        return await self.store.runs.transition(
            self.run_id,
            expect=expect,
            to=RunStatus.RUNNING,
            events=[("sandbox.ready", ready), *then],
            isolation=sandbox.isolation,
            runtime=sandbox.runtime,
            sandbox_id=sandbox.id,
            image=sandbox.image,
            image_hash=self.image_hash,
            **fields,
        )

    async def put_files(self, sandbox: Sandbox) -> None:
        """The policy's files, written before the driver starts."""
        for f in self.policy.files:
            await sandbox.put_file(f.path, f.data())

    def started(self) -> dict[str, Any]:
        """``worker.started``: what the run's driver was granted."""
        return {
            "shell": self.policy.shell,
            "web": self.policy.web_shown(),
            "connections": [c.name for c in self.policy.connections],
            "files": [f.path for f in self.policy.files],
        }

    async def release(self, sandbox: Sandbox) -> None:
        """Cut egress and destroy the sandbox; whatever fails, its compute clock stops and every
        web charge is in the ledger after (the compute charge counts what is left)."""
        try:
            await cut_egress(self.egress)
            await sandbox.destroy()
        finally:
            self.budget.sandbox_stopped = self.clock.monotonic()
            await self.web.flush()

    async def deliver_output(self, output: str | None) -> None:
        """A zero-data-retention output into custody, once, before the close: whoever sees the
        run settled must find it there. A run that keeps its data stores it with the close."""
        if self.zdr and output is not None and self.custody is not None and not self._delivered:
            await self.custody.deliver(self.run_id, output)
            self._delivered = True

    # time ----------------------------------------------------------------------------------
    def time_left(self) -> float:
        """Seconds until the driver's deadline or until compute would use up the budget."""
        return self.budget.seconds_left(self.work_deadline)

    # egress --------------------------------------------------------------------------------
    async def start_egress(self, sandbox: Sandbox) -> None:
        """The forwarder inside and the proxy outside, only when web, connections or models
        are granted; raises errors.SandboxError when the forwarder did not start."""
        attached = await start_egress(self.broker, self, sandbox, self.price_book, charges=self.web)
        if attached is not None:
            self.egress, self.egress_env = attached

    def stop(self) -> StopRun | None:
        """Why egress says the run must end now (budget out, broker failed), or None."""
        return egress_stop(self.egress, self.web)

    # the broker's context (ephemeral.broker.context.BrokerContext) --------------------------
    async def emit(self, type_: str, data: dict[str, Any]) -> None:
        await self.store.events.append(
            self.run_id, type_, redact_for_zdr(data) if self.zdr else data
        )

    def record_event(self, type_: str, data: dict[str, Any]) -> None:
        self.web.record(type_, redact_for_zdr(data) if self.zdr else data)

    async def charge_web(self, seq: int) -> int:
        return await self.web.charge_request(seq)

    async def charge_web_bytes(self, key: str, micros: int) -> int:
        return self.web.charge_bytes(key, micros)

    async def get_connection(self, name: str) -> StoredConnection:
        return await self.store.connections.get(self.org_id, name)

    def gateway_usage(self) -> tuple[int, int, int] | None:
        """Model calls, input and output tokens the sandbox's code made through the gateway
        (None: no gateway)."""
        gateway = self.egress.gateway if self.egress is not None else None
        if gateway is None:
            return None
        return gateway.calls, gateway.usage.input_tokens, gateway.usage.output_tokens
