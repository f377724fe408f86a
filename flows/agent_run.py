"""The ``agent-run`` flow: reserve, provision, model and shell steps, teardown, settle, record.

Only the run id is a flow parameter: Prefect's database stores parameters, and prompts and
outputs must not land there (zero data retention would leak through it).
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar, cast

from prefect import flow
from prefect.utilities.annotations import quote

from ephemeral.agent import Steps
from ephemeral.service import Runtime, current
from ephemeral.settings import Settings
from ephemeral.tasks.budget import reserve_budget, settle
from ephemeral.tasks.record import record
from ephemeral.tasks.sandbox import provision_sandbox, teardown
from ephemeral.tasks.steps import model_step, shell_step

T = TypeVar("T")


def _q(value: T) -> T:
    """``quote(value)``: the task receives ``value`` itself, unwalked (typed as such)."""
    return cast(T, quote(value))


# quote(): Prefect walks every task argument looking for futures to resolve; a run is a deep
# object graph (messages, store, sandbox) and walking it cost ~140 ms per run.
PREFECT_STEPS = Steps(
    provision=lambda run: provision_sandbox(_q(run)),
    model_step=lambda run: model_step(_q(run)),
    tool_step=lambda run, call: shell_step(_q(run), call),
    teardown=lambda run: teardown(_q(run)),
    settle=lambda run: settle(_q(run)),
)


async def _runtime() -> tuple[Runtime, bool]:
    runtime = current()
    if runtime is not None:
        return runtime, False
    # Started by a Prefect worker in a fresh process: build our own runtime.
    return await Runtime.start(Settings.load(), recover=False), True


def _finish_elsewhere(reason: str) -> Any:
    """A hook for cancellation/crash. It runs in another process after the flow process is
    gone, so it finds the run (and through it the sandbox) from persisted state only."""

    def hook(flow: Any, flow_run: Any, state: Any) -> None:
        run_id = (flow_run.parameters or {}).get("run_id")
        if not run_id:
            return

        async def finish() -> None:
            runtime = await Runtime.start(Settings.load(), recover=False)
            try:
                await runtime.finish_orphan(run_id, reason)
            finally:
                await runtime.close()

        asyncio.run(finish())

    return hook


@flow(
    name="agent-run",
    flow_run_name="{run_id}",
    persist_result=False,
    log_prints=False,
    on_cancellation=[_finish_elsewhere("cancelled")],
    on_crashed=[_finish_elsewhere("infra_error")],
)
async def agent_run(run_id: str) -> str:
    runtime, owned = await _runtime()
    try:
        agent = await reserve_budget(_q(runtime), run_id)
        if agent is None:
            return (await runtime.store.get_run(run_id)).status
        row = await runtime.run_agent(
            agent, PREFECT_STEPS, record=lambda rid: record(_q(runtime), rid)
        )
        return row.status
    finally:
        if owned:
            await runtime.close()
