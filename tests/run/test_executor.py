"""The executor seam: the runtime carries a run out through whatever executor it was handed,
and keeps failure settlement, cancellation and the zero-data-retention hand-off for all of them
(``ephemeral serve``'s runtime under Prefect included)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ephemeral.api.app import start_runtime
from ephemeral.engine.executor import PlainExecutor, RunHandle
from ephemeral.policy import RunRequest
from ephemeral.settings import Settings
from tests import runlevel
from tests.patience import PATIENCE
from tests.run.conftest import turn


class Counting(PlainExecutor):
    def __init__(self) -> None:
        self.executed: list[str] = []
        self.closed = 0

    async def execute(self, run: RunHandle) -> None:
        self.executed.append(run.run_id)
        await super().execute(run)

    async def close(self) -> None:
        self.closed += 1


class Broken:
    async def execute(self, run: RunHandle) -> None:
        raise RuntimeError("no way to start this run")

    async def close(self) -> None:
        return None


async def test_an_executor_that_fails_leaves_the_run_settled(run_settings: Settings) -> None:
    async with runlevel.started(run_settings, executor=Broken()) as runtime:
        org = await runtime.local_org()
        row, _ = await runtime.admit(org, RunRequest(prompt="p", model="replay/sandbox-proof"))
        row = await runtime.execute(row.id)
        events = [e.type for e in await runtime.store.events.list(row.id)]
        balance = await runtime.store.orgs.get(org)
    assert row.termination_reason == "infra_error"
    assert "RuntimeError: no way to start this run" in (row.termination_detail or "")
    assert row.settled and events[-1] == "run.settled"
    assert balance.reserved_micros == 0


@pytest.mark.sandbox
async def test_the_runtime_uses_the_executor_it_was_handed(
    run_settings: Settings, make_cassette: Callable[..., str]
) -> None:
    model = make_cassette("exec-seam", [turn("echo seam"), turn(final="seam done")])
    executor = Counting()
    async with runlevel.started(run_settings, executor=executor) as runtime:
        org = await runtime.local_org()
        row, _ = await runtime.admit(org, RunRequest(prompt="p", model=model))
        row = await runtime.execute(row.id)
    assert row.status == "succeeded", row.termination_detail
    assert executor.executed == [row.id]
    assert executor.closed == 1


@pytest.mark.sandbox
@pytest.mark.prefect
async def test_serve_executes_cancels_and_hands_out_zdr_output_on_one_runtime(
    run_settings: Settings, make_cassette: Callable[..., str]
) -> None:
    from ephemeral.engine.engine import Engine
    from ephemeral.flows.executor import FlowExecutor

    canary = "CANARY-serve-4c1e"
    model = make_cassette("serve-zdr", [turn(f"echo {canary}"), turn(final=f"{canary} done")])
    settings = run_settings.model_copy(update={"executor": "flow"})
    engines: list[Engine] = []
    build = Engine.build

    async def seen(self: Engine, run_id: str):  # type: ignore[no-untyped-def]
        engines.append(self)
        return await build(self, run_id)

    Engine.build = seen  # type: ignore[method-assign]
    try:
        async with runlevel.started(settings, opener=start_runtime, warm_pool=False) as runtime:
            org = await runtime.local_org()
            zdr, _ = await runtime.admit(
                org, RunRequest(prompt=f"p {canary}", model=model, zero_data_retention=True)
            )
            idle, _ = await runtime.admit(org, RunRequest(prompt="never runs", model=model))
            # taken here, as a worker keeps the runs it took: the watchdog ends a run nothing
            # executes after two sweeps (5-10 s), and under load the zdr run took longer than that
            runtime.taken = {idle.id}
            zdr = await runtime.launch(zdr.id)
            first = runtime.take_zdr_output(zdr.id)
            second = runtime.take_zdr_output(zdr.id)
            cancelled = await runtime.cancel(idle.id)
            settled = await runtime.wait(idle.id, timeout=PATIENCE)
    finally:
        Engine.build = build  # type: ignore[method-assign]
    assert zdr.status == "succeeded", zdr.termination_detail
    assert zdr.output is None  # never stored
    assert first is not None and canary in first and second is None
    assert cancelled.status == "cancelled" and settled.settled
    # one runtime: its own engine built the run, through an agent-run flow on this loop
    assert isinstance(runtime.executor, FlowExecutor)
    assert engines == [runtime.engine]


@pytest.mark.sandbox
@pytest.mark.prefect
async def test_a_flow_run_drives_the_run_of_the_engine_that_started_it(
    run_settings: Settings, tmp_path: Path, make_cassette: Callable[..., str]
) -> None:
    """The ``agent-run`` flow is handed its run: a second runtime started on the same loop
    (another state directory, another store) does not take the flow's run over."""
    from ephemeral.flows.executor import FlowExecutor

    model = make_cassette("two-runtimes", [turn("echo one"), turn(final="one done")])
    settings = run_settings.model_copy(update={"executor": "flow"})
    async with (
        runlevel.started(settings, executor=FlowExecutor()) as first,
        runlevel.started(
            Settings.load(state_dir=tmp_path / "other", use_prefect=False), recover=False
        ),
    ):
        org = await first.local_org()
        row, _ = await first.admit(org, RunRequest(prompt="p", model=model))
        row = await first.execute(row.id)
    assert row.status == "succeeded", row.termination_detail
    assert row.recorded_at is not None
