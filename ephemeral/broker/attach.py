"""The egress proxy attached to one sandbox, and its web charges: shared by runs and sessions.

An agent run (``ephemeral.agent.loop``) and a sandbox session (``ephemeral.sessions.manager``)
are both an ``ephemeral.engine.run.Run``: a budget inside a reservation and a sandbox with a
guest channel. The run attaches the proxy (:func:`start_egress`), charges its traffic
(:class:`WebCharges`) and implements the rest of
:class:`~ephemeral.broker.context.BrokerContext` (policy, events, time left, connection
lookup), once for both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ephemeral import errors
from ephemeral.broker import journal
from ephemeral.broker.journal import ChargeJournal
from ephemeral.lifecycle import StopRun, TerminationReason

if TYPE_CHECKING:
    from ephemeral.broker.broker import Broker
    from ephemeral.broker.context import BrokerContext
    from ephemeral.broker.egress import Egress
    from ephemeral.money.budget import RunBudget
    from ephemeral.money.pricing import PriceBook
    from ephemeral.store import Store

log = logging.getLogger("ephemeral.broker")


# A batch that fails (the store busy: "database is locked" under load) is tried again after
# these pauses; its keys are idempotent, so a batch that did commit counts once.
WRITE_RETRY_SECONDS = (0.05, 0.2, 1.0, 3.0)
# A batch follows the one before no sooner than this (unless the owner flushes): a stream
# moving hundreds of MiB a second decides a charge per MiB, and a transaction for each one or
# two cost the proxy more CPU than the bytes did. A lone charge is written at once; the
# journal holds every charge until its batch commits.
BATCH_GAP_SECONDS = 0.05


@dataclass
class WebCharges:
    """Web charges of one run or session: decided against its budget, written to its ledger.

    Egress charges (a request and its first MiB, each further MiB) are decided here in memory,
    journalled (``ephemeral.broker.journal``) and written to the ledger in batches: one writer
    task per run takes every charge decided since its last commit and writes them in one
    transaction (``store.money.charge_batch``), with the egress events recorded since
    (:meth:`record`). :meth:`flush` waits until all of them are in the store; the owner calls it
    before it charges compute and settles.
    """

    store: Store
    run_id: str
    budget: RunBudget
    price_book: PriceBook
    journal_dir: Path | None = None  # the state dir: where the journal lives (None: none kept)
    error: str | None = None  # a byte charge that was not written (the owner must stop)
    batches: int = 0  # ledger transactions the byte charges took (for tests and the bench)
    _pending: list[tuple[str, int]] = field(default_factory=list)
    _events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    _writer: asyncio.Task[None] | None = None
    _last_batch: float = float("-inf")  # when the last batch began (loop time)
    _hurry: asyncio.Event = field(default_factory=asyncio.Event)  # set by flush: no gap
    _journal: ChargeJournal | None = None
    _writes: set[asyncio.Task[None]] = field(default_factory=set)  # tracked (model.internal)

    async def charge_request(self, seq: int) -> int:
        """``BrokerContext.charge_web``: one request, written before it is sent."""
        price = self.price_book.web_request_micros()
        if not self.budget.fits(price):
            raise StopRun(
                TerminationReason.BUDGET_EXHAUSTED, "the next web request does not fit the budget"
            )
        try:
            await self.store.money.charge(self.run_id, "web", price, key=f"{self.run_id}:web:{seq}")
        except errors.BudgetExhausted as exc:
            raise StopRun(
                TerminationReason.BUDGET_EXHAUSTED, "the next web request does not fit the budget"
            ) from exc
        self.budget.charged["web_micros"] += price
        return price

    def charge_bytes(self, key: str, micros: int) -> int:
        """``BrokerContext.charge_web_bytes``, decided here, synchronously.

        The budget holds the same reservation as the ledger, less compute accrued, so it is the
        stricter of the two. The charge is journalled before this returns (so before the bytes
        it pays for move) and joins the next ledger batch.
        """
        if not self.budget.fits(micros):
            raise StopRun(TerminationReason.BUDGET_EXHAUSTED, "egress traffic used up the budget")
        full = f"{self.run_id}:{key}"
        if self.journal_dir is not None:
            if self._journal is None:
                self._journal = ChargeJournal(journal.path_for(self.journal_dir, self.run_id))
            self._journal.write(full, micros)
        self.budget.charged["web_micros"] += micros
        self._pending.append((full, micros))
        self._start_writer()
        return micros

    def record(self, type_: str, data: dict[str, Any]) -> None:
        """An event written with the next batch (one transaction with the charges)."""
        self._events.append((type_, data))
        self._start_writer()

    def _start_writer(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_all(), name=f"web-charges-{self.run_id}")

    async def _write_all(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending or self._events:
            gap = self._last_batch + BATCH_GAP_SECONDS - loop.time()
            if gap > 0 and not self._hurry.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(gap):
                        await self._hurry.wait()
            self._last_batch = loop.time()
            batch, self._pending = self._pending, []
            events, self._events = self._events, []
            for pause in (*WRITE_RETRY_SECONDS, None):
                try:
                    await self.store.money.charge_batch(self.run_id, "web", batch, events)
                    self.batches += 1
                    break
                except (errors.BudgetExhausted, errors.Conflict) as exc:
                    pause = None  # not transient: the run is settled or the ledger disagrees
                    failure: Exception = exc
                except Exception as exc:  # noqa: BLE001 - the store, busy or broken
                    failure = exc
                if pause is None:
                    log.error("%s: egress charges were not written: %s", self.run_id, failure)
                    self.error = type(failure).__name__
                    return  # the journal keeps them; the owner stops at its next step
                await asyncio.sleep(pause)

    def track(self, task: asyncio.Task[None]) -> None:
        """A write made elsewhere (a model call's settlement) that :meth:`flush` waits for."""
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def flush(self) -> None:
        """Wait until every charge decided so far is in the ledger (then the journal goes),
        the tracked writes (a gateway call's settlement) included."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)
        self._hurry.set()  # the batches go now, without their gap
        try:
            while self._writer is not None and not self._writer.done():
                await asyncio.gather(self._writer, return_exceptions=True)
                if (self._pending or self._events) and self.error is None:
                    self._start_writer()
        finally:
            self._hurry.clear()
        if self.error is None and not self._pending and self._journal is not None:
            self._journal.remove()
            self._journal = None


def egress_stop(egress: Egress | None, charges: WebCharges) -> StopRun | None:
    """Why the owner must end now because of egress (budget out, broker failed), or None."""
    if egress is not None:
        if egress.stopped is not None:
            return egress.stopped
        if egress.failed is not None:
            return StopRun(
                TerminationReason.INFRA_ERROR, f"the egress broker failed: {egress.failed}"
            )
    if charges.error is not None:
        return StopRun(
            TerminationReason.INFRA_ERROR, f"a web charge was not written: {charges.error}"
        )
    return None


async def start_egress(
    broker: Broker | None,
    ctx: BrokerContext,
    sandbox: object,
    price_book: PriceBook,
    charges: WebCharges | None = None,
) -> tuple[Egress, dict[str, str]] | None:
    """The forwarder inside and the proxy outside, only when web, connections or models are
    granted. With models (and ``charges``, the owner's budget and ledger) the proxy serves the
    model gateway too (``ephemeral.broker.gateway``), and the variables include its base URLs.

    ``sandbox`` is any sandbox (the broker imports no sandbox module); one with a guest channel
    has ``start_egress``/``stop_egress``. Returns the proxy and the variables for the sandbox's
    commands, or None (nothing granted, or a sandbox without a guest channel, as the fake).
    Raises errors.SandboxError when the forwarder did not start.
    """
    if broker is None or not broker.wants_egress(ctx.policy):
        return None
    start = getattr(sandbox, "start_egress", None)
    if start is None:
        return None
    from ephemeral.broker.egress import WINDOW

    egress = broker.egress(
        ctx,
        request_micros=price_book.web_request_micros(),
        mib_micros=price_book.web_mib_micros(),
    )
    egress.cut_all = getattr(sandbox, "stop_egress", None)
    env = broker.egress_env()
    if ctx.policy.models and charges is not None:
        from ephemeral.broker import gateway

        egress.gateway = gateway.Gateway(
            ctx,
            grants=list(ctx.policy.models),
            settings=broker.settings,
            price_book=price_book,
            charges=charges,
        )
        env |= gateway.env()
    await start(
        egress.handle,
        port=broker.settings.egress_port,
        max_streams=broker.settings.egress_max_streams,
        window=WINDOW,
    )
    return egress, env


async def cut_egress(egress: Egress | None) -> None:
    """Cut every stream before the sandbox goes: none outlives its owner's bookkeeping."""
    if egress is not None and egress.cut_all is not None:
        with contextlib.suppress(errors.SandboxError, ConnectionError):
            await egress.cut_all()
    if egress is not None and egress.gateway is not None:
        await egress.gateway.aclose()
