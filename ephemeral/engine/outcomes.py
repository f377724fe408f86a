"""What a run (or a suite's planned run) came to, for grading: pass, fail, error, cancelled, budget.

A run's status says how it ended; its outcome says whether the model can be blamed. Only
``pass`` and ``fail`` are *graded*: the model was given its chance and the checks judged it.
``error`` is the infrastructure's (the sandbox died or could not start or was wrecked, a
setup command of the task failed, the provider or our own code failed, the run was refused
at admission): it is counted apart and never scored as the model's failure, nor, whatever
its checks say, as a pass. ``cancelled`` (someone stopped it) and ``budget`` (the money ran
out, or it never started for lack of it) are neither.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any

from ephemeral.lifecycle import OPEN_STATUSES, RunStatus, TerminationReason


class Outcome(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"
    CANCELLED = "cancelled"
    BUDGET = "budget"


OUTCOMES: tuple[Outcome, ...] = tuple(Outcome)
GRADED: frozenset[Outcome] = frozenset({Outcome.PASS, Outcome.FAIL})

# Termination reasons that are not the model's doing. A timeout or a policy violation is: the
# model spent its time or asked for what it may not have, and is graded for it.
_INFRASTRUCTURE = frozenset(
    {
        TerminationReason.SANDBOX_ERROR,
        TerminationReason.INFRA_ERROR,
        TerminationReason.MODEL_ERROR,  # the provider failed (5xx, refused, malformed)
        TerminationReason.SETUP_FAILED,  # the task's own setup, before the model's first turn
    }
)


def outcome_of(status: str, reason: str | None, verdicts: Iterable[bool] | None = None) -> Outcome:
    """The outcome of a run that ended ``status`` for ``reason`` with these check verdicts
    (None or empty: the run had no checks, and passes when it succeeded).

    ``status`` may also be what an eval writes for a planned run that never ran: ``skipped``
    (no budget left for it), ``refused`` (admission refused it) or ``error`` (it could not be
    started or followed to its end).
    """
    if status == "skipped":
        return Outcome.BUDGET
    if status in ("refused", "error"):
        return Outcome.ERROR
    if reason in _INFRASTRUCTURE:
        return Outcome.ERROR
    if status == RunStatus.CANCELLED or reason == TerminationReason.CANCELLED:
        return Outcome.CANCELLED
    if status == RunStatus.BUDGET_EXHAUSTED or reason == TerminationReason.BUDGET_EXHAUSTED:
        return Outcome.BUDGET
    if status in OPEN_STATUSES:
        return Outcome.ERROR  # asked of a run that has not ended: nothing to grade yet
    found = list(verdicts or ())
    if found:
        return Outcome.PASS if all(found) else Outcome.FAIL
    return Outcome.PASS if status == RunStatus.SUCCEEDED else Outcome.FAIL


def outcome_of_labels(status: str, reason: str | None, labels: Mapping[str, Any]) -> Outcome:
    """:func:`outcome_of` for a stored run, whose verdicts (if an eval judged it) are in its
    labels as ``checks``."""
    checks = labels.get("checks")
    verdicts = (
        [bool(c.get("passed")) for c in checks if isinstance(c, Mapping)]
        if isinstance(checks, list)
        else None
    )
    return outcome_of(status, reason, verdicts)


def count(outcomes: Iterable[str]) -> dict[str, int]:
    """How many of each outcome, every outcome present (zero or not), in :data:`OUTCOMES` order."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for o in outcomes:
        counts[Outcome(o)] += 1
    return {str(k): v for k, v in counts.items()}
