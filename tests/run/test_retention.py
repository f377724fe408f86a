"""Retention: content past its time is purged from the store and the records; billing stays."""

from __future__ import annotations

import asyncio

from typer.testing import CliRunner

from ephemeral.cli import app
from ephemeral.policy import RunRequest
from ephemeral.records import Records
from ephemeral.settings import Settings
from tests import runlevel
from tests.sample import SAMPLE_PROMPT


async def test_purge_erases_content_and_keeps_billing(run_settings: Settings) -> None:
    async with runlevel.started(run_settings, check=True) as runtime:
        org = await runtime.local_org()
        row, _ = await runtime.admit(
            org, RunRequest(prompt=SAMPLE_PROMPT, model="replay/sandbox-proof")
        )
        row = await runtime.execute(row.id)
    assert row.prompt == SAMPLE_PROMPT and row.output

    summary = run_settings.state_dir / "evals" / "suite_old.json"
    summary.parent.mkdir(parents=True)
    summary.write_text('{"reason": "output said keep me"}')
    # The CLI runs its own event loop: invoke it from a thread, as a separate command would.
    result = await asyncio.to_thread(
        CliRunner().invoke,
        app,
        ["records", "purge", "--retention-days", "0"],
        env={"EPHEMERAL_STATE_DIR": str(run_settings.state_dir)},
    )
    assert result.exit_code == 0, result.output
    assert "1 stored runs" in result.output
    assert "removed 1 eval summary files" in result.output
    assert not summary.exists()

    async with runlevel.started(run_settings, check=True) as runtime:
        after = await runtime.store.runs.get(row.id)
        events = await runtime.store.events.list(row.id)
    assert after.prompt is None and after.output is None
    assert (after.charged_micros, after.refunded_micros) == (
        row.charged_micros,
        row.refunded_micros,
    )
    shell = [e.data for e in events if e.type == "shell.executed"]
    assert shell and all("command" not in d and "stdout" not in d for d in shell)
    _, rows = Records(run_settings.records_dir).query(
        f"select prompt, output, charged_micros from runs where run_id = '{row.id}'"
    )
    assert rows == [(None, None, row.charged_micros)]
