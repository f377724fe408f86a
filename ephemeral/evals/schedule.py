"""Running a plan under money caps and a concurrency bound (the money rule is the package's)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from ephemeral import errors
from ephemeral.evals.result import RunResult, unrun
from ephemeral.recipes.recipe import PlannedRun


@dataclass
class Cap:
    """A money cap over a group of runs (a recipe, a suite); ``limit`` None means uncapped."""

    name: str
    limit: int | None
    committed: int = 0

    def fits(self, amount: int) -> bool:
        return self.limit is None or self.committed + amount <= self.limit

    @property
    def left(self) -> int | None:
        return None if self.limit is None else self.limit - self.committed


Start = Callable[[PlannedRun], Awaitable[RunResult]]


async def run_planned(
    planned: Iterable[PlannedRun],
    caps_for: Callable[[PlannedRun], Sequence[Cap]],
    start: Start,
    *,
    concurrency: int,
    on_result: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Run the plan in order, at most ``concurrency`` at a time, never passing any cap.

    ``start`` runs one planned run to the end. Results come back in plan order. The plan is
    consumed as runs start, so a streamed plan is never held whole.
    """
    if concurrency < 1:
        raise errors.InvalidRequest.field("concurrency", "must be at least 1")
    results: dict[int, RunResult] = {}
    changed = asyncio.Condition()
    in_flight = 0
    tasks: list[asyncio.Task[None]] = []

    async def one(i: int, p: PlannedRun, caps: Sequence[Cap], amount: int) -> None:
        nonlocal in_flight
        try:
            result = await start(p)
            # Not admitted: nothing was spent. Ran: give back what was not charged.
            refund = amount if result.run_id is None else max(0, amount - result.charged_micros)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one broken run must not stop the others
            detail = exc.detail if isinstance(exc, errors.EphemeralError) else repr(exc)
            result = unrun(p, "error", detail)
            refund = 0  # admitted or not, spent or not: unknown, so it stays committed
        for cap in caps:
            cap.committed -= refund
        results[i] = result
        async with changed:
            in_flight -= 1
            changed.notify_all()
        if on_result is not None:
            on_result(result)

    for i, p in enumerate(planned):
        caps = caps_for(p)
        amount = p.policy.max_cost_micros
        async with changed:
            while True:
                fits = all(c.fits(amount) for c in caps)
                if in_flight < concurrency and fits:
                    break
                if not fits and in_flight == 0:
                    break
                await changed.wait()
            if not fits:
                tight = next(c for c in caps if not c.fits(amount))
                result = unrun(
                    p,
                    "skipped",
                    (f"budget: {tight.name} has {tight.left} micros left, the run needs {amount}"),
                )
                results[i] = result
                if on_result is not None:
                    on_result(result)
                continue
            for cap in caps:
                cap.committed += amount
            in_flight += 1
        tasks.append(asyncio.create_task(one(i, p, caps, amount)))
        tasks = [t for t in tasks if not t.done()]  # finished ones: nothing left to hold
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    return [results[i] for i in sorted(results)]
