"""Pairing a suite run's runs with a previous one's: which checks flipped, what the pairs cost."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from ephemeral.evals.result import RunResult


class Flip(BaseModel):
    pair_key: str
    check: str
    was: bool
    now: bool


class Comparison(BaseModel):
    previous_suite_run_id: str
    paired: int
    new: int  # runs with no twin in the previous suite run
    missing: int  # runs of the previous suite run with no twin now
    flips: list[Flip]
    cost_delta_micros: int  # over paired runs: now minus before
    previous_charged_micros: int

    @property
    def regressions(self) -> list[Flip]:
        return [f for f in self.flips if f.was and not f.now]

    @property
    def fixes(self) -> list[Flip]:
        return [f for f in self.flips if not f.was and f.now]


def compare(
    current: Sequence[RunResult], previous: Sequence[RunResult], previous_id: str
) -> Comparison:
    """Pair runs by :func:`pair_key`: which checks flipped, and the cost delta of the pairs."""
    before = {r.pair_key: r for r in previous}
    now = {r.pair_key: r for r in current if r.run_id is not None}
    flips: list[Flip] = []
    delta = 0
    paired = 0
    for key, run in now.items():
        old = before.get(key)
        if old is None or old.run_id is None:
            continue
        paired += 1
        delta += run.charged_micros - old.charged_micros
        old_checks = {c.check: c.passed for c in old.checks}
        for c in run.checks:
            if c.check in old_checks and old_checks[c.check] != c.passed:
                flips.append(
                    Flip(pair_key=key, check=c.check, was=old_checks[c.check], now=c.passed)
                )
    return Comparison(
        previous_suite_run_id=previous_id,
        paired=paired,
        new=sum(1 for k in now if k not in before),
        missing=sum(1 for k in before if k not in now),
        flips=flips,
        cost_delta_micros=delta,
        previous_charged_micros=sum(r.charged_micros for r in previous),
    )
