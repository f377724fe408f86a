"""A run as the broker sees it (``BrokerContext``), in memory: no runtime, store or sandbox.

Events, charges and connection lookups are recorded for the test to read; the budget is a plain
number and running out of it raises :class:`OutOfBudget` (an ``AgentRun`` raises its StopRun
there; the broker lets either propagate).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ephemeral import errors
from ephemeral.broker import Broker, Sealer
from ephemeral.broker.context import BrokerContext
from ephemeral.policy import Policy
from ephemeral.providers.base import ToolCall
from ephemeral.store.connections import StoredConnection

PRICE = 1000  # what the fake charges per web request (the shipped price book's figure)
_ids = itertools.count()


class OutOfBudget(Exception):
    pass


@dataclass
class FakeContext:
    policy: Policy
    budget_micros: int = 1_000_000
    seconds_left: float = 60.0
    connections: dict[str, StoredConnection] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    charges: list[tuple[int, int]] = field(default_factory=list)  # (seq, micros)

    async def emit(self, type_: str, data: dict[str, Any]) -> None:
        self.events.append((type_, data))

    def record_event(self, type_: str, data: dict[str, Any]) -> None:
        self.events.append((type_, data))

    async def charge_web(self, seq: int) -> int:
        if self.charged + PRICE > self.budget_micros:
            raise OutOfBudget(seq)
        self.charges.append((seq, PRICE))
        return PRICE

    async def charge_web_bytes(self, key: str, micros: int) -> int:
        if self.charged + micros > self.budget_micros:
            raise OutOfBudget(key)
        self.charges.append((-1, micros))
        return micros

    def time_left(self) -> float:
        return self.seconds_left

    async def get_connection(self, name: str) -> StoredConnection:
        if name not in self.connections:
            raise errors.NotFound(f"no connection {name!r}")
        return self.connections[name]

    @property
    def charged(self) -> int:
        return sum(m for _, m in self.charges)

    def of(self, *types: str) -> list[dict[str, Any]]:
        return [data for t, data in self.events if t in types]

    def connect(self, sealer: Sealer, name: str, base_url: str, headers: dict[str, str]) -> None:
        self.connections[name] = StoredConnection(
            org_id="org_test",
            name=name,
            base_url=base_url,
            header_names=list(headers),
            sealed_headers=sealer.seal(headers),
            created_at=datetime.now(UTC),
        )


async def ask(broker: Broker, ctx: FakeContext, tool: str, /, **arguments: Any) -> str:
    """One tool call, answered by the broker the way the loop asks for it."""
    checked: BrokerContext = ctx  # mypy on this file checks the fake is a BrokerContext
    return await broker.handle(
        ToolCall(id=f"call_{next(_ids)}", name=tool, arguments=arguments), ctx=checked
    )
