"""The recipe/suite money cap: committed worst case never passes the cap; runs stop starting."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ephemeral.evals.result import RunResult
from ephemeral.evals.schedule import Cap, run_planned
from ephemeral.policy import Policy
from ephemeral.recipes.recipe import PlannedRun


def planned(n: int, cost: int, recipe: str = "r") -> list[PlannedRun]:
    return [
        PlannedRun(
            recipe=recipe,
            prompt="p",
            model="replay/x",
            policy=Policy(max_cost_micros=cost),
            cell={},
            repeat_index=i,
        )
        for i in range(n)
    ]


class Ledger:
    """A fake run starter that checks the caps at every start and charges a set amount."""

    def __init__(self, caps: list[Cap], charge: dict[int, int] | int, concurrency: int) -> None:
        self.caps = caps
        self.charge = charge
        self.concurrency = concurrency
        self.in_flight = 0
        self.started: list[PlannedRun] = []
        self.peak = 0

    async def start(self, p: PlannedRun) -> RunResult:
        for cap in self.caps:
            assert cap.limit is None or cap.committed <= cap.limit, cap
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        assert self.in_flight <= self.concurrency
        self.started.append(p)
        await asyncio.sleep(0.001 * (p.repeat_index % 3))
        self.in_flight -= 1
        charged = self.charge if isinstance(self.charge, int) else self.charge[p.repeat_index]
        assert charged <= p.policy.max_cost_micros
        return RunResult(
            pair_key=p.pair_key(),
            recipe=p.recipe,
            repeat_index=p.repeat_index,
            run_id=f"run_{p.repeat_index:032x}",
            status="succeeded",
            reserved_micros=p.policy.max_cost_micros,
            charged_micros=charged,
        )


async def test_runs_stop_starting_when_the_next_would_not_fit() -> None:
    cap = Cap("recipe r", 100)
    ledger = Ledger([cap], charge=10, concurrency=2)
    results = await run_planned(planned(10, 40), lambda p: [cap], ledger.start, concurrency=2)
    # Six finished runs hold 60 (their charges) and a seventh in flight holds 40: 100.
    # An eighth would need 70 + 40 > 100, with nothing left in flight to give money back.
    assert len(ledger.started) == 7
    assert [r.status for r in results] == ["succeeded"] * 7 + ["skipped"] * 3
    assert all("budget" in (r.detail or "") for r in results[7:])
    assert cap.committed == 70 and sum(r.charged_micros for r in results) == 70
    assert ledger.peak == 2


async def test_a_run_waits_for_refunds_instead_of_passing_the_cap() -> None:
    cap = Cap("suite s", 50)
    ledger = Ledger([cap], charge=1, concurrency=4)
    results = await run_planned(planned(3, 40), lambda p: [cap], ledger.start, concurrency=4)
    # Only one 40-micro run fits at a time even though four slots are free.
    assert ledger.peak == 1
    assert [r.status for r in results] == ["succeeded"] * 3
    assert cap.committed == 3


async def test_refused_runs_give_everything_back_and_errors_keep_it() -> None:
    cap = Cap("recipe r", 100)

    async def start(p: PlannedRun) -> RunResult:
        if p.repeat_index == 0:
            return RunResult(pair_key=p.pair_key(), recipe="r", status="refused", detail="402")
        raise OSError("sandbox exploded")

    results = await run_planned(planned(3, 40), lambda p: [cap], start, concurrency=1)
    assert [r.status for r in results] == ["refused", "error", "error"]
    assert "sandbox exploded" in (results[1].detail or "")
    # Refused: nothing spent. Errors: unknown spend, so their whole worst case stays committed.
    assert cap.committed == 80


async def test_suite_and_recipe_caps_both_hold() -> None:
    suite = Cap("suite", 100)
    caps = {"a": [suite, Cap("recipe a", 40)], "b": [suite, Cap("recipe b", None)]}
    plan = planned(3, 40, "a") + planned(3, 30, "b")
    ledger = Ledger([suite, *caps["a"][1:]], charge=0, concurrency=3)
    ledger.charge = 0
    results = await run_planned(plan, lambda p: caps[p.recipe], ledger.start, concurrency=3)
    assert all(r.status == "succeeded" for r in results)  # charges of 0 give everything back
    assert suite.committed == 0


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.integers(1, 50), min_size=1, max_size=12),
    spend=st.lists(st.floats(0, 1), min_size=12, max_size=12),
    budget=st.integers(1, 200),
    concurrency=st.integers(1, 4),
)
def test_the_cap_is_never_passed(
    costs: list[int], spend: list[float], budget: int, concurrency: int
) -> None:
    cap = Cap("recipe", budget)
    plan = [
        PlannedRun(
            recipe="r",
            prompt="p",
            model="replay/x",
            policy=Policy(max_cost_micros=c),
            cell={},
            repeat_index=i,
        )
        for i, c in enumerate(costs)
    ]
    charges = {i: int(c * spend[i]) for i, c in enumerate(costs)}
    ledger = Ledger([cap], charge=charges, concurrency=concurrency)
    results = asyncio.run(run_planned(plan, lambda p: [cap], ledger.start, concurrency=concurrency))
    assert len(results) == len(plan)
    assert cap.committed == sum(r.charged_micros for r in results) <= budget
    for r, p in zip(results, plan, strict=True):
        # A run is skipped only when even an idle scheduler could not fit it.
        if r.status == "skipped":
            assert p.policy.max_cost_micros > budget - sum(
                x.charged_micros for x in results[: p.repeat_index]
            )


async def test_concurrency_must_be_positive() -> None:
    from ephemeral.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        await run_planned(planned(1, 1), lambda p: [], lambda p: None, concurrency=0)  # type: ignore[arg-type,return-value]
