"""The egress proxy attached to one sandbox, and its web charges: shared by runs and sessions.

An agent run (``ephemeral.agent``) and a sandbox session (``ephemeral.sessions``) both hold a
budget inside a reservation and a sandbox with a guest channel. Both attach the proxy the same
way (:func:`start_egress`) and charge its traffic the same way (:class:`WebCharges`); each
implements the rest of :class:`~ephemeral.broker.context.BrokerContext` (policy, events, time
left, connection lookup) over its own state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ephemeral import errors
from ephemeral.lifecycle import StopRun, TerminationReason

if TYPE_CHECKING:
    from ephemeral.broker.broker import Broker
    from ephemeral.broker.context import BrokerContext
    from ephemeral.broker.egress import Egress
    from ephemeral.budget import RunBudget
    from ephemeral.pricing import PriceBook
    from ephemeral.store import Store

log = logging.getLogger("ephemeral.broker")


@dataclass
class WebCharges:
    """Web charges of one run or session: decided against its budget, written to its ledger."""

    store: Store
    run_id: str
    budget: RunBudget
    price_book: PriceBook
    error: str | None = None  # a byte charge that was not written (the owner must stop)
    _writes: set[asyncio.Task[None]] = field(default_factory=set)

    async def charge_request(self, seq: int) -> int:
        """``BrokerContext.charge_web``: one request, written before it is sent."""
        price = self.price_book.web_request_micros()
        if not self.budget.fits(price):
            raise StopRun(
                TerminationReason.BUDGET_EXHAUSTED, "the next web request does not fit the budget"
            )
        try:
            await self.store.charge(self.run_id, "web", price, key=f"{self.run_id}:web:{seq}")
        except errors.BudgetExhausted as exc:
            raise StopRun(
                TerminationReason.BUDGET_EXHAUSTED, "the next web request does not fit the budget"
            ) from exc
        self.budget.charged["web_micros"] += price
        return price

    def charge_bytes(self, key: str, micros: int) -> int:
        """``BrokerContext.charge_web_bytes``, decided here, synchronously.

        The budget holds the same reservation as the ledger, less compute accrued, so it is the
        stricter of the two. The ledger row is written beside the request (a SQLite commit
        would double a proxied request's latency); :meth:`flush` waits for every such write,
        and teardown calls it before settling.
        """
        if not self.budget.fits(micros):
            raise StopRun(TerminationReason.BUDGET_EXHAUSTED, "egress traffic used up the budget")
        self.budget.charged["web_micros"] += micros
        task = asyncio.create_task(self._write(f"{self.run_id}:{key}", micros))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return micros

    async def _write(self, key: str, micros: int) -> None:
        try:
            await self.store.charge(self.run_id, "web", micros, key=key)
        except Exception as exc:  # noqa: BLE001 - recorded; the owner stops at its next step
            log.error("%s: an egress charge was not written: %s", self.run_id, exc)
            self.error = type(exc).__name__

    def track(self, task: asyncio.Task[None]) -> None:
        """A write made elsewhere (a model call's settlement) that :meth:`flush` waits for."""
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def flush(self) -> None:
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)


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
