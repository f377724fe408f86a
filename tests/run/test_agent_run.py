"""Whole runs: real sandbox (auto), replayed model turns, real SQLite ledger and Parquet records."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from pathlib import Path

import pytest

from ephemeral.engine.runtime import Runtime
from ephemeral.models import NO_MODEL
from ephemeral.policy import RunRequest
from ephemeral.records import Records
from ephemeral.runview import fold_events, run_object
from ephemeral.settings import Settings
from tests import runlevel
from tests.goldenlog import assert_golden_log
from tests.run.conftest import turn
from tests.sample import SAMPLE_PROMPT

POOL_PATIENCE = 900.0  # a bound against a hung boot only (boots take minutes at load 40)

pytestmark = [pytest.mark.sandbox]


def types(events: list) -> list[str]:
    return [e.type for e in events]


async def run_to_end(runtime: Runtime, request: RunRequest, **labels: object):
    org = await runtime.local_org()
    row, _ = await runtime.admit(org, request, labels=dict(labels) or None)
    row = await runtime.execute(row.id)
    events = await runtime.store.events.list(row.id)
    return row, events


def assert_settled(row, events) -> None:
    assert row.charged_micros + row.refunded_micros == row.reserved_micros
    assert 0 <= row.charged_micros <= row.reserved_micros
    assert types(events)[-1] == "run.settled"
    assert "sandbox.destroyed" in types(events) or "sandbox.ready" not in types(events)
    # docs/architecture.md: the log alone rebuilds the row's status, usage and money
    folded = fold_events(events)
    assert folded["status"] == row.status
    assert folded["cost"]["reserved_micros"] == row.reserved_micros
    assert folded["cost"]["charged_micros"] == row.charged_micros
    assert folded["cost"]["refunded_micros"] == row.refunded_micros
    assert folded["usage"] == {k: (row.usage or {}).get(k, 0) for k in folded["usage"]}
    assert not folded["sandbox_alive"]


async def test_sample_run_matches_the_product_page(runtime: Runtime) -> None:
    row, events = await run_to_end(
        runtime, RunRequest(prompt=SAMPLE_PROMPT, model="replay/sandbox-proof")
    )
    assert row.status == "succeeded", row.termination_detail
    assert types(events)[:3] == ["run.queued", "sandbox.ready", "worker.started"]
    assert types(events)[-4:] == ["sandbox.destroyed", "run.succeeded", "run.output", "run.settled"]
    shell = [e.data for e in events if e.type == "shell.executed"]
    assert len(shell) >= 4
    outputs = "\n".join(s["stdout"] + s["stderr"] for s in shell)
    assert "worker" in outputs  # whoami, really run in the sandbox
    assert "/tmp/ephemeral-run-" in outputs  # pwd
    assert "Could not resolve host" in outputs  # curl without network
    assert "2 3 5 7 11 13 17 19 23 29 31 37 41 43 47" in outputs
    assert row.usage["model_calls"] == 3
    assert row.output and "network" in row.output.lower()
    assert_settled(row, events)
    b = row.breakdown
    assert b["model_micros"] > 0 and b["compute_micros"] > 0 and b["web_micros"] == 0
    assert sum(b.values()) == row.charged_micros
    obj = run_object(row)
    assert obj["cost"]["reserved_micros"] == 40_000
    assert obj["termination"] == {"reason": "completed", "detail": None}
    assert_golden_log("run", events)


async def test_records_are_written_and_queryable(runtime: Runtime, run_settings) -> None:
    row, _ = await run_to_end(
        runtime,
        RunRequest(prompt=SAMPLE_PROMPT, model="replay/sandbox-proof"),
        recipe="sandbox-proof",
    )
    recs = Records(run_settings.records_dir)
    _, rows = recs.query(
        f"select status, charged_micros, recipe from runs where run_id = '{row.id}'"
    )
    assert rows == [("succeeded", row.charged_micros, "sandbox-proof")]
    _, steps = recs.query(
        f"select kind, count(*) from steps where run_id = '{row.id}' group by 1 order by 1"
    )
    assert dict(steps)["model"] == 3 and dict(steps)["shell"] >= 4


async def test_an_agent_run_naming_no_model_records_none(run_settings: Settings) -> None:
    """Its program calls no model: the run, its records and `costs --by model` say `(none)`,
    never the default (here replay/sandbox-proof, which the sample's runs keep)."""
    settings = run_settings.model_copy(update={"default_model": "replay/sandbox-proof"})
    request = RunRequest.model_validate(
        {
            "prompt": "count to three",
            "timeout_seconds": 60,
            "agent": {"command": 'echo "model=[$EPHEMERAL_MODEL]"; echo 1 2 3'},
        }
    )
    async with runlevel.started(settings) as runtime:
        row, events = await run_to_end(runtime, request)
    assert row.status == "succeeded", row.termination_detail
    assert row.model == NO_MODEL and run_object(row)["model"] == NO_MODEL
    assert row.output is not None and "model=[]" in row.output  # granted none
    started = next(e.data for e in events if e.type == "agent.started")
    assert started["models"] == []
    _, by_model = Records(run_settings.records_dir).query(
        f"select model from runs where run_id = '{row.id}'"
    )
    assert by_model == [(NO_MODEL,)]


async def test_budget_exhausted_stops_before_overspending(
    runtime: Runtime, make_cassette: Callable[..., str]
) -> None:
    model = make_cassette(
        "loop", [turn("echo step", tokens=(20_000, 200)) for _ in range(10)] + [turn(final="done")]
    )
    row, events = await run_to_end(
        runtime, RunRequest(prompt="loop", model=model, max_cost_micros=3000)
    )
    assert row.status == "budget_exhausted"
    assert row.termination_reason == "budget_exhausted"
    assert "budget.warning" in types(events)
    assert types(events).count("budget.warning") == 1
    assert_settled(row, events)
    assert any(e.type == "shell.executed" for e in events)  # what was done is kept
    assert_golden_log("run-budget-exhausted", events, loop=True)


async def test_time_limit_kills_the_step_and_destroys_the_sandbox(
    run_settings: Settings, make_cassette: Callable[..., str]
) -> None:
    model = make_cassette("sleepy", [turn("sleep 1000"), turn(final="never")])
    # The time limit counts from the slot grant, the sandbox's boot included: a cold boot on a
    # loaded host used up all 3 s (no sandbox, nothing to kill). A warm one is adopted at once.
    settings = run_settings.model_copy(update={"pool_size": 1})
    async with runlevel.started(settings, check=True, warm_pool=True) as runtime:
        [pool] = runtime.sandboxes.pools.values()
        await pool.wait_ready(POOL_PATIENCE)
        row, events = await run_to_end(
            runtime, RunRequest(prompt="sleep", model=model, timeout_seconds=3)
        )
    assert row.status == "timed_out", row.termination_detail
    assert_settled(row, events)
    lifetime = next(e.data["lifetime_ms"] for e in events if e.type == "sandbox.destroyed")
    assert lifetime < 1000 * 1000  # the step's `sleep 1000` was cut short, not waited out


async def test_tools_not_granted_are_refused(
    runtime: Runtime, make_cassette: Callable[..., str]
) -> None:
    model = make_cassette("noshell", [turn("id"), turn(final="I could not run it.")])
    row, events = await run_to_end(runtime, RunRequest(prompt="try", model=model, shell=False))
    assert row.status == "succeeded"
    assert "shell.executed" not in types(events)
    transcript = await runtime.store.transcripts.get(row.id)
    assert transcript is not None and len(transcript) == 2


async def test_files_are_written_into_scratch(
    runtime: Runtime, make_cassette: Callable[..., str]
) -> None:
    model = make_cassette("files", [turn("cat data/input.csv; pwd"), turn(final="ok")])
    content = base64.b64encode(b"a,b\n1,2\n").decode()
    _, events = await run_to_end(
        runtime,
        RunRequest(
            prompt="read",
            model=model,
            files=[{"path": "data/input.csv", "content_base64": content}],
        ),
    )
    shell = next(e.data for e in events if e.type == "shell.executed")
    assert shell["stdout"].startswith("a,b\n1,2\n")
    started = next(e.data for e in events if e.type == "worker.started")
    assert started["files"] == ["data/input.csv"]


async def test_cancel_destroys_the_sandbox_and_settles(
    runtime: Runtime, make_cassette: Callable[..., str]
) -> None:
    model = make_cassette("cancelme", [turn("sleep 1000"), turn(final="never")])
    org = await runtime.local_org()
    row, _ = await runtime.admit(org, RunRequest(prompt="x", model=model, timeout_seconds=60))
    task = runtime.launch(row.id)
    async for ev in runtime.events(row.id, follow=True):
        if ev.type == "model.called":  # its `sleep 1000` comes next
            break
    await asyncio.sleep(0.5)
    cancelled = await runtime.cancel(row.id)
    assert cancelled.status == "cancelled"
    again = await runtime.cancel(row.id)  # idempotent
    assert again.status == "cancelled"
    with pytest.raises(asyncio.CancelledError):
        await task
    events = await runtime.store.events.list(row.id)
    assert_settled(await runtime.store.runs.get(row.id), events)
    assert_golden_log("run-cancelled", events)


async def test_zero_data_retention_leaves_no_content_anywhere(
    runtime: Runtime, run_settings, make_cassette: Callable[..., str], tmp_path: Path
) -> None:
    canary = "CANARY-7f3a9c"
    model = make_cassette("zdr", [turn(f"echo {canary}-out"), turn(final=f"{canary} final")])
    row, events = await run_to_end(
        runtime,
        RunRequest(
            prompt=f"secret {canary} prompt",
            model=model,
            zero_data_retention=True,
        ),
    )
    assert row.status == "succeeded"
    assert runtime.take_zdr_output(row.id) == f"{canary} final"
    assert runtime.take_zdr_output(row.id) is None  # delivered once
    await runtime.store.close()
    touched = [p for p in run_settings.state_dir.rglob("*") if p.is_file()]
    assert touched
    for path in touched:
        assert canary.encode() not in path.read_bytes(), path
    shell = next(e.data for e in events if e.type == "shell.executed")
    assert "command" not in shell and shell["command_bytes"] > 0
