"""A run's budget inside its reservation: worst-case holds before model calls, compute accrual.

The run's reservation (``max_cost_micros``) is made on the org at admission by the store.
Inside the run, this object decides whether the *next* step can still fit, so the run stops with
``budget_exhausted`` before it could overspend, never after.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ephemeral.clock import SYSTEM, Clock


@dataclass
class RunBudget:
    reserved_micros: int
    compute_micros_per_second: float
    charged: dict[str, int] = field(
        default_factory=lambda: {"model_micros": 0, "web_micros": 0, "compute_micros": 0}
    )
    sandbox_started: float | None = None  # clock.monotonic()
    sandbox_stopped: float | None = None
    warned: bool = False
    clock: Clock = SYSTEM

    # compute -------------------------------------------------------------------------------
    def sandbox_seconds(self, now: float | None = None) -> float:
        if self.sandbox_started is None:
            return 0.0
        end = (
            self.sandbox_stopped
            if self.sandbox_stopped is not None
            else (now if now is not None else self.clock.monotonic())
        )
        return max(0.0, end - self.sandbox_started)

    def compute_accrued(self, now: float | None = None) -> int:
        return math.ceil(self.sandbox_seconds(now) * self.compute_micros_per_second)

    # totals --------------------------------------------------------------------------------
    def non_compute_spent(self) -> int:
        return self.charged["model_micros"] + self.charged["web_micros"]

    def spent(self, now: float | None = None) -> int:
        return self.non_compute_spent() + self.compute_accrued(now)

    def remaining(self, now: float | None = None) -> int:
        return max(0, self.reserved_micros - self.spent(now))

    def fits(self, amount: int, now: float | None = None) -> bool:
        return amount <= self.remaining(now)

    def compute_deadline(self) -> float | None:
        """Monotonic time at which compute alone would use up what is left of the budget.

        The sandbox must be destroyed by then: compute is the one cost that grows on its own.
        """
        if self.sandbox_started is None or self.compute_micros_per_second <= 0:
            return None
        left = self.reserved_micros - self.non_compute_spent()
        return self.sandbox_started + max(0.0, left / self.compute_micros_per_second)

    def seconds_left(self, deadline: float) -> float:
        """Seconds until ``deadline`` (``clock.monotonic()``) or the compute deadline, whichever
        is first."""
        compute = self.compute_deadline()
        limit = deadline if compute is None else min(deadline, compute)
        return limit - self.clock.monotonic()

    def should_warn(self) -> bool:
        """True exactly once, when spending first reaches 80 % of the reservation."""
        if self.warned or self.reserved_micros <= 0:
            return False
        if self.spent() * 5 >= self.reserved_micros * 4:
            self.warned = True
            return True
        return False
