"""The eval flows under real Prefect (the session's server): subflows, artifacts, no content."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ephemeral.flows.executor import executor_for
from ephemeral.settings import Settings
from tests import runlevel
from tests.evals.conftest import write_cassette
from tests.recipes.helpers import write

pytestmark = [pytest.mark.sandbox, pytest.mark.prefect, pytest.mark.slow]

CANARY = "CANARY-evalflow-77c3"


async def test_eval_suite_and_recipe_run_flows(tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterName,
    )

    from ephemeral.flows.eval_suite import eval_suite_flow
    from ephemeral.flows.recipe_run import recipe_run_flow

    cassettes = tmp_path / "cassettes"
    model = write_cassette(cassettes, "evalflow", [f"echo {CANARY}"], f"said {CANARY}")
    settings = Settings.load(
        state_dir=tmp_path / "state", cassettes_dir=cassettes, use_prefect=True
    )
    recipe = write(
        tmp_path,
        f"""
        name: canary_echo
        model: {model}
        prompt: echo the canary
        matrix: {{flavour: [plain, again]}}
        policy: {{timeout_seconds: 60, max_cost_micros: 20000}}
        checks:
          - status: succeeded
          - output_matches: "CANARY-evalflow-[0-9a-f]+"
          - output_contains: "not there"
    """,
        name="canary.yaml",
    )
    suite = write(
        tmp_path,
        f"name: flows\nrecipes: [{recipe}]\ngates: {{min_pass_rate: 0}}\n",
        name="suite.yaml",
    )
    async with runlevel.started(settings, executor=executor_for(settings)) as runtime:
        # The flows are handed the runtime: they look nothing up.
        first = await eval_suite_flow(runtime)(suite=str(suite))
        second = await recipe_run_flow(runtime)(recipe=str(recipe), compare=first["suite_run_id"])
    assert first["passed"] is True and first["runs"] == 2 and first["passing"] == 0
    assert second["regressions"] == 0 and len(second["run_ids"]) == 2
    assert (settings.state_dir / "evals" / f"{first['suite_run_id']}.md").is_file()

    async with get_client() as client:
        # Every run was an agent-run subflow, named by its run id, with only the id as parameter.
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=first["run_ids"] + second["run_ids"])
            )
        )
        assert len(runs) == 4
        for run in runs:
            assert run.parent_task_run_id is not None
            assert run.state is not None and run.state.is_completed()
            assert set(run.parameters) == {"run_id"}
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(
                    any_=[
                        "eval-canary-echo",
                        "eval-flows",
                        "eval-table-canary-echo",
                        "eval-table-flows",
                    ]
                )
            )
        )
    kinds = sorted((a.key, a.type) for a in artifacts)
    assert ("eval-flows", "markdown") in kinds and ("eval-table-flows", "table") in kinds
    assert ("eval-canary-echo", "markdown") in kinds
    md = next(a for a in artifacts if a.key == "eval-canary-echo").data
    assert f"Compared with `{first['suite_run_id']}`" in str(md)
    assert "| canary_echo | (all checks) | 0/2 |" in str(md)
    # Check reasons quote the output; they stay out of Prefect's database.
    for path in Path(os.environ["PREFECT_HOME"]).rglob("*"):
        if path.is_file():
            assert CANARY.encode() not in path.read_bytes(), path
