"""What the broker needs from a run, and nothing more.

The broker sees a run only through :class:`BrokerContext`: its policy, its event log, a charge
for one web request, the time it has left, and its org's stored connections. ``Run``
implements it (in ``ephemeral.engine.run``) for agent runs and sandbox sessions alike; tests use a
small in-memory one. The broker never imports the run, so the two can change (and be tested)
apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ephemeral.policy import Policy
    from ephemeral.store.connections import StoredConnection


class BrokerContext(Protocol):
    @property
    def policy(self) -> Policy: ...

    async def emit(self, type_: str, data: dict[str, Any]) -> None:
        """Append an event to the run (redacted as the run's policy says)."""
        ...

    def record_event(self, type_: str, data: dict[str, Any]) -> None:
        """Append an event with the run's next batch of egress charges, in their transaction
        (redacted as ``emit``): written by the time the run's charges are flushed."""
        ...

    async def charge_web(self, seq: int) -> int:
        """Charge the run's ``seq``-th web request inside its budget *before* it is sent; the
        price. Raises the run's own stop (reason ``budget_exhausted``) when it does not fit:
        the broker lets it propagate, so the run ends."""
        ...

    async def charge_web_bytes(self, key: str, micros: int) -> int:
        """Charge ``micros`` for bytes through the egress proxy, inside the budget, before they
        move; ``key`` is unique within the run. Raises the run's stop like ``charge_web``."""
        ...

    def time_left(self) -> float:
        """Seconds until the run's deadline (wall clock or compute budget, whichever is first)."""
        ...

    async def get_connection(self, name: str) -> StoredConnection:
        """The run's org's stored connection ``name``; raises errors.NotFound."""
        ...
