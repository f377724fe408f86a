"""The replayed answers of the shipped recipes are true of the real guest.

A cassette fixes what the model says; the sandbox decides what the commands print. This runs
every recorded tool call of each replay recipe in a real sandbox, then judges the recipe's
output and shell checks (the ones that do not need a whole settled run) against the real
shell events and the cassette's final answer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ephemeral.recipes.checks import MaxCost, MaxDuration, StatusIs, evaluate
from ephemeral.recipes.recipe import load_recipe
from ephemeral.settings import Settings
from tests.drivers import unavailable

REPO = Path(__file__).resolve().parents[2]
RECIPES = ["sandbox-proof", "exit-codes", "file-roundtrip", "hostile-agent"]

pytestmark = pytest.mark.sandbox


def _cassette(name: str) -> dict[str, Any]:
    return json.loads((REPO / "recipes/cassettes" / f"{name}.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", RECIPES)
def test_cassette_shape(name: str) -> None:
    turns = _cassette(name)["turns"]
    *calls, last = turns
    assert last["message"]["content"] and not last["message"].get("tool_calls")
    for turn in calls:
        assert turn["message"]["tool_calls"]
        for call in turn["message"]["tool_calls"]:
            assert call["name"] == "shell" and set(call["arguments"]) == {"command"}


@pytest.mark.parametrize("name", RECIPES)
async def test_recorded_answer_holds_in_a_real_sandbox(name: str, tmp_path: Path) -> None:
    ns = pytest.importorskip("ephemeral.sandbox.namespaces", reason="no namespaces driver")
    from ephemeral.sandbox import images
    from ephemeral.sandbox.base import Limits

    settings = Settings.load(state_dir=tmp_path / "state")
    if images.built_rootfs(settings) is None:
        unavailable("guest image not built (make setup)", "namespaces")
    driver = ns.NamespacesDriver(settings)
    why = await driver.probe()
    if why:
        unavailable(f"namespaces sandbox unavailable: {why}", "namespaces")

    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml")
    assert recipe.model == f"replay/{name}"
    cassette = _cassette(name)
    events: list[dict[str, Any]] = []
    sbx = await driver.create(owner=f"test-{name}", limits=Limits())
    try:
        for spec in recipe.policy.files:
            await sbx.put_file(f"{sbx.workdir}/{spec.path}", spec.data())
        for turn in cassette["turns"]:
            for call in turn["message"].get("tool_calls") or []:
                command = call["arguments"]["command"]
                result = await sbx.exec(command, cwd=sbx.workdir, timeout=30)
                events.append(
                    {
                        "seq": len(events) + 1,
                        "run_id": "run_test",
                        "type": "shell.executed",
                        "at": "2026-11-29T10:00:00.000Z",
                        "data": {"command": command, **result.model_dump(exclude={"timed_out"})},
                    }
                )
    finally:
        await sbx.destroy()

    run = {"status": "succeeded", "output": cassette["turns"][-1]["message"]["content"]}
    judged = [c for c in recipe.checks if not isinstance(c, MaxCost | MaxDuration | StatusIs)]
    assert judged, "a replay recipe should check what its commands did"
    failures = [r for r in evaluate(judged, run, events) if not r.passed]
    assert not failures, (failures, [e["data"] for e in events])


EVAL_RECIPES = ["fix-the-test"]


@pytest.mark.parametrize("name", EVAL_RECIPES)
def test_eval_cassette_shape(name: str) -> None:
    turns = _cassette(name)["turns"]
    assert turns[-1]["message"]["content"] and not turns[-1]["message"].get("tool_calls")
    assert all(t["message"]["tool_calls"] for t in turns[:-1])


@pytest.mark.parametrize("name", EVAL_RECIPES)
async def test_eval_cassette_holds_for_every_dataset_row(name: str, tmp_path: Path) -> None:
    """For each planned run (each dataset row): files_from, setup, the recorded commands and
    verify in a real sandbox of the recipe's image; then every check but those that need a
    settled run is judged against what really happened."""
    ns = pytest.importorskip("ephemeral.sandbox.namespaces", reason="no namespaces driver")
    from ephemeral.recipes.recipe import expand
    from ephemeral.sandbox import images
    from ephemeral.sandbox.base import Limits

    recipe = load_recipe(REPO / "recipes" / "evals" / f"{name}.yaml")
    assert recipe.model == f"replay/{name}" and recipe.image
    settings = Settings.load(state_dir=tmp_path / "state").model_copy(
        update={"image": recipe.image}
    )
    built = images.built_image(settings, recipe.image)
    if built is None:
        unavailable(f"image {recipe.image} not built (make setup)", "namespaces")
    driver = ns.NamespacesDriver(settings)
    if why := await driver.probe():
        unavailable(f"namespaces sandbox unavailable: {why}", "namespaces")
    cassette = _cassette(name)
    planned = expand(recipe, default_model="unused/model")
    assert len(planned) == 3
    for run in planned:
        events: list[dict[str, Any]] = []

        def record(kind: str, command: str, result: Any, events: list = events) -> None:
            data = {"command": command, **result.model_dump()}
            events.append({"seq": len(events) + 1, "type": kind, "data": data})

        async with await driver.create(owner=f"test-{name}", limits=Limits()) as sbx:
            for spec in run.policy.files:
                await sbx.put_file(f"{sbx.workdir}/{spec.path}", spec.data())
            for command in run.policy.setup:
                res = await sbx.exec(command, cwd=sbx.workdir, env=built.env, timeout=60)
                assert res.exit_code == 0, (run.cell, command, res)
            for turn in cassette["turns"]:
                for call in turn["message"].get("tool_calls") or []:
                    command = call["arguments"]["command"]
                    res = await sbx.exec(command, cwd=sbx.workdir, env=built.env, timeout=60)
                    record("shell.executed", command, res)
            for command in run.policy.verify:
                res = await sbx.exec(command, cwd=sbx.workdir, env=built.env, timeout=60)
                record("verify.executed", command, res)
        out = {"status": "succeeded", "output": cassette["turns"][-1]["message"]["content"]}
        judged = [c for c in recipe.checks if not isinstance(c, MaxCost | MaxDuration | StatusIs)]
        failures = [r for r in evaluate(judged, out, events) if not r.passed]
        assert not failures, (run.cell, failures, [e["data"] for e in events])
