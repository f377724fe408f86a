"""The run through real Prefect: a flow run per run, a task run per step, no content in Prefect."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from ephemeral.flows.executor import executor_for
from ephemeral.flows.prefect_client import RetryWhenBusy
from ephemeral.policy import RunRequest
from ephemeral.settings import Settings
from tests import runlevel
from tests.run.conftest import turn
from tests.sample import SAMPLE_PROMPT

pytestmark = [pytest.mark.sandbox, pytest.mark.prefect, pytest.mark.slow]


@pytest.fixture
def prefect_settings(run_settings: Settings) -> Settings:
    return Settings.load(
        state_dir=run_settings.state_dir,
        cassettes_dir=run_settings.cassettes_dir,
        use_prefect=True,
    )


async def test_sample_runs_as_a_prefect_flow(
    prefect_settings: Settings, make_cassette: Callable[..., str]
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    canary = "CANARY-prefect-91b2"
    model = make_cassette("zdr-prefect", [turn(f"echo {canary}"), turn(final=f"{canary} done")])
    executor = executor_for(prefect_settings)
    async with runlevel.started(prefect_settings, executor=executor) as runtime:
        org = await runtime.local_org()
        # Each admitted just before it executes: a run admitted here and left unexecuted for
        # two watchdog sweeps (the first flow on a loaded box takes longer) is abandoned.
        sample, _ = await runtime.admit(
            org, RunRequest(prompt=SAMPLE_PROMPT, model="replay/sandbox-proof")
        )
        sample = await runtime.execute(sample.id)
        zdr, _ = await runtime.admit(
            org, RunRequest(prompt=f"p {canary}", model=model, zero_data_retention=True)
        )
        zdr = await runtime.execute(zdr.id)
        # the embedded server's 503s (a SQLite write collision) are sent again in milliseconds
        transport = executor._client.client._client._transport  # type: ignore[attr-defined]
        assert isinstance(transport, RetryWhenBusy)
    assert sample.status == "succeeded", sample.termination_detail
    assert zdr.status == "succeeded", zdr.termination_detail

    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[sample.id]))
        )
        assert len(runs) == 1
        assert runs[0].state is not None and runs[0].state.is_completed()
        assert runs[0].parameters == {"run_id": sample.id}
        tasks = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[sample.id]))
        )
    names = Counter(t.name.rsplit("-", 1)[0] for t in tasks)
    assert names["load_run"] == 1
    assert names["provision_sandbox"] == 1
    assert names["agent_turn"] == 3  # one task per model call and the commands it asked for
    assert names["teardown"] == 1 and names["settle"] == 1
    assert sum(names.values()) == 7

    prefect_home = Path(os.environ["PREFECT_HOME"])
    for path in prefect_home.rglob("*"):
        if path.is_file():
            assert canary.encode() not in path.read_bytes(), path


async def test_an_agent_run_is_one_agent_command_task_of_its_flow(
    prefect_settings: Settings,
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    async with runlevel.started(
        prefect_settings, executor=executor_for(prefect_settings)
    ) as runtime:
        org = await runtime.local_org()
        row, _ = await runtime.admit(
            org,
            RunRequest.model_validate(
                {
                    "prompt": "the prompt",
                    "model": "replay/sandbox-proof",
                    "timeout_seconds": 60,
                    "agent": {"command": 'cat "$EPHEMERAL_PROMPT_FILE"; echo " was read"'},
                }
            ),
        )
        row = await runtime.execute(row.id)
        events = [e.type for e in await runtime.store.events.list(row.id)]
    assert row.status == "succeeded", row.termination_detail
    assert row.output == "the prompt was read\n"
    assert (
        events.index("agent.started") < events.index("agent.exited") < events.index("run.settled")
    )
    assert "model.called" not in events and "shell.executed" not in events
    assert row.charged_micros + row.refunded_micros == row.reserved_micros

    async with get_client() as client:
        tasks = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[row.id]))
        )
    names = Counter(t.name.rsplit("-", 1)[0] for t in tasks)
    assert names == Counter(
        {"load_run": 1, "provision_sandbox": 1, "agent_command": 1, "teardown": 1, "settle": 1}
    )
