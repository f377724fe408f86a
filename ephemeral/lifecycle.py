"""A run's statuses, its kinds, its termination reasons and the rules between them, in one place.

A run moves ``queued → provisioning → running → <terminal>`` and is then settled; every move is
one store transaction that writes the run row and its events together, guarded by the status
the run is expected to be in (``store.runs.transition``, ``store.runs.close``: see
:mod:`ephemeral.store.runs`). Both check each move against :data:`TRANSITIONS`, the one table
of legal ``(from, to)`` pairs. The values are the strings of the wire and the
database: a ``StrEnum`` member *is* its string.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from enum import StrEnum

from ephemeral import errors


class RunStatus(StrEnum):
    QUEUED = "queued"
    PROVISIONING = "provisioning"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    BUDGET_EXHAUSTED = "budget_exhausted"


class RunKind(StrEnum):
    """What a row of the runs table is. The store writes NULL for a run (rows from before kinds
    existed are runs) and ``session`` for a sandbox session; the records and the API say
    ``run`` or ``session``: :func:`kind_of` reads either."""

    RUN = "run"
    SESSION = "session"


def kind_of(stored: str | None) -> RunKind:
    """The kind of a run row whose ``kind`` column holds ``stored`` (NULL is a run)."""
    return RunKind.RUN if stored is None else RunKind(stored)


class TerminationReason(StrEnum):
    COMPLETED = "completed"
    TIMEOUT = "timeout"
    BUDGET_EXHAUSTED = "budget_exhausted"
    CANCELLED = "cancelled"
    POLICY_VIOLATION = "policy_violation"
    MODEL_ERROR = "model_error"
    SANDBOX_ERROR = "sandbox_error"
    INFRA_ERROR = "infra_error"
    SETUP_FAILED = "setup_failed"  # a setup command of the request failed before the first turn


OPEN_STATUSES: frozenset[RunStatus] = frozenset(
    {RunStatus.QUEUED, RunStatus.PROVISIONING, RunStatus.RUNNING}
)
TERMINAL_STATUSES: frozenset[RunStatus] = frozenset(RunStatus) - OPEN_STATUSES
# Open with its clock started (the slot grant): its time limit counts, its sandbox may be up.
STARTED_STATUSES: frozenset[RunStatus] = frozenset({RunStatus.PROVISIONING, RunStatus.RUNNING})

# Every legal move of a run's status. A terminal status is final: nothing leaves it, not even
# to itself (a second close of an ended run changes nothing and is not a move).
TRANSITIONS: frozenset[tuple[RunStatus, RunStatus]] = frozenset(
    {
        # A host takes a dispatched run: it records itself and its lease, and the run waits on.
        (RunStatus.QUEUED, RunStatus.QUEUED),
        # The run got a slot; its time counts from here.
        (RunStatus.QUEUED, RunStatus.PROVISIONING),
        # A sandbox session is attached and ready in one step; it has no provisioning phase.
        (RunStatus.QUEUED, RunStatus.RUNNING),
        (RunStatus.PROVISIONING, RunStatus.RUNNING),
        # Any open run can end, for any reason (a queued one by cancel or a dead host).
        *((open_, end) for open_ in OPEN_STATUSES for end in TERMINAL_STATUSES),
    }
)


def check_transition(expect: Collection[RunStatus], to: RunStatus) -> None:
    """Refuse a move whose table row is missing, for any status the caller expects to leave.

    Checked before the compare-and-set: the store's update applies only while the run is in one
    of ``expect``, so a move that passes here is legal whichever of them the run is in.
    """
    if not expect:
        raise errors.IllegalTransition(f"a move to {to} must name the statuses it leaves")
    illegal = sorted(
        f"{RunStatus(s)} -> {RunStatus(to)}" for s in expect if (s, to) not in TRANSITIONS
    )
    if illegal:
        raise errors.IllegalTransition(
            f"illegal run status transition {', '.join(illegal)} (see lifecycle.TRANSITIONS)"
        )


STATUS_FOR_REASON: dict[TerminationReason, RunStatus] = {
    TerminationReason.COMPLETED: RunStatus.SUCCEEDED,
    TerminationReason.TIMEOUT: RunStatus.TIMED_OUT,
    TerminationReason.BUDGET_EXHAUSTED: RunStatus.BUDGET_EXHAUSTED,
    TerminationReason.CANCELLED: RunStatus.CANCELLED,
    TerminationReason.POLICY_VIOLATION: RunStatus.FAILED,
    TerminationReason.MODEL_ERROR: RunStatus.FAILED,
    TerminationReason.SANDBOX_ERROR: RunStatus.FAILED,
    TerminationReason.INFRA_ERROR: RunStatus.FAILED,
    TerminationReason.SETUP_FAILED: RunStatus.FAILED,
}


def compute_charge(
    *, micros_per_second: float, seconds: float, reserved_micros: int, other_spent_micros: int
) -> int:
    """What a sandbox's lifetime costs, never past what the reservation has left.

    The agent's teardown (from its own clock) and the runtime abandoning a run (from the
    events' timestamps) both charge through this, under the one ledger key ``<run>:compute``.
    """
    accrued = math.ceil(max(0.0, seconds) * micros_per_second)
    return max(0, min(accrued, reserved_micros - other_spent_micros))


class StopRun(Exception):
    """Ends a run's loop with a termination reason; raised by steps, caught by the driver."""

    def __init__(self, reason: TerminationReason, detail: str | None = None) -> None:
        self.reason = TerminationReason(reason)
        super().__init__(detail or self.reason)
        self.detail = detail
