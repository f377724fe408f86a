"""An infrastructure error is not the model's: a sandbox killed from the host mid-run ends the run
``error``, counted apart in the pass table, the export and the gate (issue 37, outcomes).

Two recipes in one suite run, on real sandboxes: ``killed`` asks the replay model to run
``sleep 120`` and its sandbox's processes are killed from the host while the command runs;
``healthy`` runs to the end. Both would pass their checks otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

import pytest

from ephemeral.evals.execute import Watchers
from ephemeral.evals.plan import Evaluation
from ephemeral.evals.store import write_report
from ephemeral.evals.suite import run_evaluation
from ephemeral.recipes.recipe import load_recipe
from ephemeral.records.export import export_suite_run
from ephemeral.sandbox import handles
from ephemeral.sandbox.registry import probe_level
from ephemeral.settings import Settings
from tests import runlevel
from tests.drivers import unavailable
from tests.evals.conftest import write_cassette
from tests.recipes.helpers import write

pytestmark = pytest.mark.sandbox


def _recipe(root: Path, name: str, model: str, isolation: str) -> object:
    return load_recipe(
        write(
            root,
            f"""
        name: {name}
        model: {model}
        prompt: "run it"
        verify: ["echo graded"]
        labels: {{team: evals}}
        policy: {{isolation: {isolation}, timeout_seconds: 90, max_cost_micros: 20000}}
        checks:
          - verify: {{exit_code: 0, stdout_contains: graded}}
    """,
            name=f"{name}.yaml",
        )
    )


async def _kill_sandbox_of(run_ids: list[str], sandboxes_dir: Path) -> str:
    """Wait for the first run's sandbox, let its command start, then SIGKILL every host process
    the sandbox's handle names (its process group and pids): the sandbox dies under the run."""
    while not run_ids:
        await asyncio.sleep(0.05)
    owner = run_ids[0]
    while True:
        found = [
            h for _, h in handles.read_all(sandboxes_dir) if h is not None and h.owner == owner
        ]
        if found and (found[0].pgid or found[0].pids):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(3)  # the model's `sleep 120` is running by now (or the sandbox boots)
    handle = found[0]
    with contextlib.suppress(ProcessLookupError):
        if handle.pgid:
            os.killpg(handle.pgid, signal.SIGKILL)
    for pid in handle.pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return owner


@pytest.mark.parametrize("isolation", ["namespaces", "gvisor"])
async def test_a_sandbox_killed_mid_run_is_an_error_in_table_export_and_gate(
    tmp_path: Path, isolation: str
) -> None:
    cassettes = tmp_path / "cassettes"
    doomed = write_cassette(cassettes, "doomed", ["sleep 120"], "done")
    fine = write_cassette(cassettes, "fine", ["true"], "done")
    settings = Settings.load(
        state_dir=tmp_path / "state", cassettes_dir=cassettes, use_prefect=False
    )
    if why := await probe_level(isolation, settings):
        unavailable(f"{isolation} unavailable: {why}", isolation)
    recipes = [
        _recipe(tmp_path, "killed", doomed, isolation),
        _recipe(tmp_path, "healthy", fine, isolation),
    ]
    admitted: list[str] = []
    async with runlevel.started(settings) as runtime:
        killer = asyncio.create_task(_kill_sandbox_of(admitted, settings.sandboxes_dir))
        report = await run_evaluation(
            runtime,
            Evaluation(
                name="outcomes",
                recipes=recipes,  # type: ignore[arg-type]
                concurrency=1,
                min_pass_rate=1.0,
                watchers=Watchers(admitted=admitted.append),
            ),
        )
        killed_run = await asyncio.wait_for(killer, 10)

    killed, healthy = report.results
    assert killed.run_id == killed_run
    assert (killed.status, killed.termination_reason) == ("failed", "sandbox_error"), killed
    assert killed.outcome == "error" and not killed.passed
    assert healthy.outcome == "pass", healthy
    assert report.outcomes == {"pass": 1, "fail": 0, "error": 1, "cancelled": 0, "budget": 0}

    # The gate: the healthy recipe passes on its graded run; the killed one fails apart, as an
    # error that was not graded, never as a pass rate of 0%.
    assert report.gate_failures == ["killed: 1 error not graded (0/1 runs graded)"]

    # The pass table (the Markdown report, as the CLI writes it).
    md = Path(write_report(report, settings)).with_suffix(".md").read_text()
    assert "| killed | (all checks) | 0/0 | 0% | 1 | 0 | 0 |" in md
    assert "| healthy | (all checks) | 1/1 | 100% | 0 | 0 | 0 |" in md
    assert f"`killed/{{}}/0`: error (failed, `{killed_run}`)" in md

    # The export, from the records.
    out = tmp_path / "samples.jsonl"
    assert export_suite_run(settings.records_dir, report.suite_run_id, out) == 2
    rows = {r["recipe"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert (rows["killed"]["outcome"], rows["killed"]["passed"]) == ("error", False)
    assert rows["killed"]["termination_reason"] == "sandbox_error"
    assert (rows["healthy"]["outcome"], rows["healthy"]["passed"]) == ("pass", True)
    # The recipe's labels, beside the runner's own, on every run (costs --by label:team).
    assert rows["healthy"]["labels"] == {
        "recipe": "healthy",
        "suite_run_id": report.suite_run_id,
        "team": "evals",
    }
