"""The soak's "charged for queueing" check flags what it names and passes a fair charge.

Pure functions of ``bench/soak.py`` on hand-made run objects: the soak itself (real ``serve``,
hundreds of runs) is the bench; this pins down what its check counts as a queueing charge.
"""

from __future__ import annotations

from typing import Any

from bench.soak import Outcome, charged_while_queued

RATE = 100  # µ$ per sandbox second


def outcome(
    *,
    started: str | None = "2026-12-02T05:00:10Z",
    ended: str = "2026-12-02T05:00:30Z",
    ready: str | None = "2026-12-02T05:00:12Z",
    lifetime_ms: int | None = 15_000,
    compute: int = 1_500,
    charged: int | None = None,
) -> Outcome:
    events: list[dict[str, Any]] = [{"type": "run.queued", "at": "2026-12-02T05:00:00Z"}]
    if ready is not None:
        events.append({"type": "sandbox.ready", "at": ready, "data": {"boot_ms": 5}})
    if lifetime_ms is not None:
        events.append(
            {"type": "sandbox.destroyed", "at": ended, "data": {"lifetime_ms": lifetime_ms}}
        )
    events.append({"type": "run.settled", "at": ended})
    run = {
        "created_at": "2026-12-02T05:00:00Z",
        "started_at": started,
        "ended_at": ended,
        "cost": {
            "charged_micros": compute if charged is None else charged,
            "breakdown": {"compute_micros": compute},
        },
    }
    return Outcome(run=run, events=events)


def test_a_charge_for_the_sandbox_lifetime_is_fair() -> None:
    assert not charged_while_queued(outcome(), RATE)


def test_a_late_sandbox_ready_write_is_not_a_queueing_charge() -> None:
    # The ready event's store write landed 4 s after the attach (a loaded box): the lifetime
    # (15 s, from attach) is longer than ready → end (14 s) and still fair.
    assert not charged_while_queued(outcome(ready="2026-12-02T05:00:16Z"), RATE)


def test_a_charge_past_the_sandbox_lifetime_is_flagged() -> None:
    assert charged_while_queued(outcome(compute=1_500 + 2 * RATE), RATE)


def test_a_sandbox_before_the_slot_grant_is_flagged() -> None:
    assert charged_while_queued(outcome(ready="2026-12-02T05:00:09Z"), RATE)


def test_a_lifetime_longer_than_slot_grant_to_end_is_flagged() -> None:
    # 25 s of sandbox inside 20 s between the slot grant and the end: part of it was queueing.
    assert charged_while_queued(outcome(lifetime_ms=25_000, compute=2_500), RATE)


def test_compute_without_a_sandbox_is_flagged() -> None:
    assert charged_while_queued(outcome(ready=None, lifetime_ms=None, compute=10), RATE)
    assert not charged_while_queued(outcome(ready=None, lifetime_ms=None, compute=0), RATE)


def test_a_charge_on_a_run_that_never_got_a_slot_is_flagged() -> None:
    never = outcome(started=None, ready=None, lifetime_ms=None, compute=0, charged=5)
    assert charged_while_queued(never, RATE)
    free = outcome(started=None, ready=None, lifetime_ms=None, compute=0, charged=0)
    assert not charged_while_queued(free, RATE)
