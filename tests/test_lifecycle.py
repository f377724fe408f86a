"""The one list of statuses and reasons, and the one compute-charge rule."""

from __future__ import annotations

import json

import pytest

from ephemeral.lifecycle import (
    OPEN_STATUSES,
    STATUS_FOR_REASON,
    TERMINAL_STATUSES,
    RunStatus,
    StopRun,
    TerminationReason,
    compute_charge,
)


def test_members_are_their_wire_strings() -> None:
    assert json.dumps([RunStatus.TIMED_OUT, TerminationReason.MODEL_ERROR]) == (
        '["timed_out", "model_error"]'
    )
    assert f"run.{RunStatus.BUDGET_EXHAUSTED}" == "run.budget_exhausted"
    assert set(RunStatus) == OPEN_STATUSES | TERMINAL_STATUSES
    assert not OPEN_STATUSES & TERMINAL_STATUSES


def test_every_reason_ends_in_a_terminal_status() -> None:
    assert set(STATUS_FOR_REASON) == set(TerminationReason)
    assert set(STATUS_FOR_REASON.values()) == TERMINAL_STATUSES


def test_stop_run_takes_only_a_known_reason() -> None:
    assert StopRun(TerminationReason.TIMEOUT).reason is TerminationReason.TIMEOUT
    with pytest.raises(ValueError):
        StopRun("ran_out_of_coffee")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("seconds", "spent", "expected"),
    [
        (0.0, 0, 0),
        (1.5, 0, 150),  # 100 micros a second
        (1.001, 0, 101),  # a started micro-dollar is charged
        (10.0, 600, 400),  # capped at what the reservation has left
        (10.0, 1_000, 0),
        (-1.0, 0, 0),  # clocks that disagree never make a negative charge
    ],
)
def test_compute_charge(seconds: float, spent: int, expected: int) -> None:
    got = compute_charge(
        micros_per_second=100, seconds=seconds, reserved_micros=1_000, other_spent_micros=spent
    )
    assert got == expected
