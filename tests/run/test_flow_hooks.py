"""agent-run's cancellation and crash hooks. Prefect's runner calls a sync hook in a thread of
its own after the flow's process is gone: there the hook ends the run from persisted state.
Where the flow ran in this process (an executor of ``serve``/``run``/``eval`` started it),
Prefect's flow engine calls the hook on the very loop whose engine drives the run: the hook
leaves the run to that engine (it used to call ``asyncio.run`` there, which raised, and Prefect
logged the error and a coroutine never awaited at every in-process crash)."""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path
from uuid import uuid4

import pytest
from prefect.client.schemas.objects import FlowRun
from prefect.states import Crashed

from ephemeral.engine import exits
from ephemeral.engine.runtime import Runtime
from ephemeral.flows.agent_run import agent_run
from ephemeral.lifecycle import RunStatus, TerminationReason
from ephemeral.policy import RunRequest
from tests.api.conftest import new_member


def _flow_run(run_id: str) -> FlowRun:
    return FlowRun(flow_id=uuid4(), name=run_id, parameters={"run_id": run_id})


async def test_on_the_loop_that_drives_the_run_the_hook_leaves_it_to_its_engine(
    runtime: Runtime,
) -> None:
    member = await new_member(runtime, "inproc")
    row, _ = await runtime.admit(
        member.org_id, RunRequest(prompt="driven here", model="replay/sandbox-proof")
    )
    [crashed] = agent_run.on_crashed_hooks
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" fails the test
        crashed(agent_run, _flow_run(row.id), Crashed())
    assert (await runtime.store.runs.get(row.id)).status == RunStatus.QUEUED
    await runtime.engine.end(row.id, exits.cancelled("the test is done with it"))


async def test_in_the_runners_thread_the_hook_ends_the_run(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = runtime.settings
    monkeypatch.setenv("EPHEMERAL_STATE_DIR", str(settings.state_dir))
    monkeypatch.setenv("EPHEMERAL_CASSETTES_DIR", str(Path(settings.cassettes_dir)))
    monkeypatch.setenv("EPHEMERAL_USE_PREFECT", "false")
    member = await new_member(runtime, "runner")
    row, _ = await runtime.admit(
        member.org_id, RunRequest(prompt="its process is gone", model="replay/sandbox-proof")
    )
    [crashed] = agent_run.on_crashed_hooks
    # as Prefect's runner calls a sync hook: in a new thread, no loop running there
    await asyncio.to_thread(crashed, agent_run, _flow_run(row.id), Crashed())
    done = await runtime.store.runs.get(row.id)
    assert done.status == RunStatus.FAILED
    assert done.termination_reason == TerminationReason.INFRA_ERROR
    assert done.termination_detail == "the run's process died"
    assert done.settled
    assert (await runtime.store.orgs.get(member.org_id)).reserved_micros == 0
