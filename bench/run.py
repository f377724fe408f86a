"""End-to-end wall of the product page's sample (replayed model, real sandbox), split by where
the time goes, and 50 concurrent sample runs. Prints numbers; asserts nothing.

    .venv/bin/python bench/run.py [--runs 10] [--concurrent 50] [--no-prefect-only]

sandbox       = provision (boot + files) + shell execs + destroy, timed around the driver calls
model         = time inside the provider (a replay returns recorded turns: ~0)
orchestration = the rest: Prefect flow/task engine, ledger, events, records
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ephemeral import prefect_setup
from ephemeral.flows.executor import executor_for
from ephemeral.policy import RunRequest
from ephemeral.providers.replay import cassette_path, load_cassette
from ephemeral.settings import Settings

# replay/sandbox-proof answers only the prompt it recorded (the product page's sample)
PROMPT = str(load_cassette(cassette_path(Settings.load().cassettes_dir, "sandbox-proof")).prompt)


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    k = max(0, min(len(values) - 1, round(p / 100 * (len(values) - 1))))
    return values[k]


class Timers:
    """Wraps the runtime's sandbox acquisition and provider so their time can be subtracted."""

    def __init__(self) -> None:
        self.sandbox = 0.0
        self.model = 0.0


def instrument(runtime: Any, timers: Timers) -> None:
    engine = runtime.engine  # the run engine builds each run (ephemeral/engine/engine.py)
    build = engine.build

    async def timed_build(run_id: str) -> Any:
        agent = await build(run_id)
        acquire, provider = agent.acquire_sandbox, agent.provider

        async def timed_acquire(owner: str, limits: Any) -> Any:
            t0 = time.perf_counter()
            sandbox = await acquire(owner, limits)
            timers.sandbox += time.perf_counter() - t0
            exec_, destroy = sandbox.exec, sandbox.destroy

            async def timed_exec(*a: Any, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await exec_(*a, **kw)
                finally:
                    timers.sandbox += time.perf_counter() - t

            async def timed_destroy() -> None:
                t = time.perf_counter()
                try:
                    await destroy()
                finally:
                    timers.sandbox += time.perf_counter() - t

            sandbox.exec, sandbox.destroy = timed_exec, timed_destroy
            return sandbox

        class TimedProvider:
            async def complete(self, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await provider.complete(**kw)
                finally:
                    timers.model += time.perf_counter() - t

        agent.acquire_sandbox = timed_acquire
        agent.provider = TimedProvider()
        return agent

    engine.build = timed_build


async def sequential(settings: Settings, runs: int) -> dict[str, list[float]]:
    from ephemeral.engine.runtime import Runtime

    runtime = await Runtime.start(settings, executor=executor_for(settings))
    out: dict[str, list[float]] = {"wall": [], "sandbox": [], "model": [], "orchestration": []}
    try:
        org = await runtime.local_org()
        for i in range(runs + 1):  # the first run warms imports and Prefect's server
            timers = Timers()
            instrument(runtime, timers)
            row, _ = await runtime.admit(
                org, RunRequest(prompt=PROMPT, model="replay/sandbox-proof")
            )
            t0 = time.perf_counter()
            row = await runtime.execute(row.id)
            wall = time.perf_counter() - t0
            assert row.status == "succeeded", row.termination_detail
            if i == 0:
                continue
            out["wall"].append(wall)
            out["sandbox"].append(timers.sandbox)
            out["model"].append(timers.model)
            out["orchestration"].append(wall - timers.sandbox - timers.model)
    finally:
        await runtime.close()
    return out


async def concurrent(settings: Settings, n: int) -> tuple[float, list[Any]]:
    from ephemeral.engine.runtime import Runtime

    runtime = await Runtime.start(settings, executor=executor_for(settings))
    try:
        org = await runtime.local_org()
        rows = [
            (await runtime.admit(org, RunRequest(prompt=PROMPT, model="replay/sandbox-proof")))[0]
            for _ in range(n)
        ]
        t0 = time.perf_counter()
        done = await asyncio.gather(*(runtime.execute(r.id) for r in rows))
        return time.perf_counter() - t0, done
    finally:
        await runtime.close()


def report(label: str, data: dict[str, list[float]]) -> None:
    print(f"\n{label} (n={len(data['wall'])})")
    for key in ("wall", "sandbox", "model", "orchestration"):
        v = data[key]
        print(
            f"  {key:<14} p50 {statistics.median(v) * 1000:8.1f} ms"
            f"   p95 {pct(v, 95) * 1000:8.1f} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--concurrent", type=int, default=50)
    ap.add_argument("--no-prefect-only", action="store_true")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ephemeral-bench-run-"))
    plain = Settings.load(state_dir=base / "plain", use_prefect=False, max_concurrent_runs=64)
    prefect_setup.configure(plain)

    baseline = asyncio.run(sequential(plain, args.runs))
    report("sample, plain steps (baseline: same loop without Prefect)", baseline)
    if not args.no_prefect_only:
        flows = Settings.load(state_dir=base / "prefect", use_prefect=True, max_concurrent_runs=64)
        with_prefect = asyncio.run(sequential(flows, args.runs))
        report("sample, agent-run Prefect flow", with_prefect)
        ratio = statistics.median(with_prefect["wall"]) / statistics.median(baseline["wall"])
        print(f"  Prefect / plain wall p50 ratio: {ratio:.2f}x")

    wall, rows = asyncio.run(concurrent(plain, args.concurrent))
    ok = sum(r.status == "succeeded" for r in rows)
    over = sum(r.charged_micros > r.reserved_micros for r in rows)
    bad_sum = sum(r.charged_micros + r.refunded_micros != r.reserved_micros for r in rows)
    print(
        f"\n{args.concurrent} concurrent sample runs (plain steps): {ok}/{len(rows)} succeeded, "
        f"total wall {wall:.1f} s, overshoot {over}, settle mismatches {bad_sum}"
    )


if __name__ == "__main__":
    main()
