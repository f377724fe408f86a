"""Every shipped recipe and suite validates, and the product page sample is the page's request."""

from __future__ import annotations

from pathlib import Path

import pytest

from ephemeral.recipes.recipe import (
    expand,
    iter_recipes,
    load_any,
    load_recipe,
    load_suite,
    validate_recipe,
)
from ephemeral.settings import Settings
from tests.sample import SAMPLE_PROMPT

REPO = Path(__file__).resolve().parents[2]
SHIPPED = [
    *sorted((REPO / "recipes").glob("*.yaml")),
    *sorted((REPO / "recipes/evals").glob("*.yaml")),
    *sorted((REPO / "recipes/suites").glob("*.yaml")),
]

PAGE_PROMPT = SAMPLE_PROMPT


def test_there_is_something_to_check() -> None:
    names = {p.name for p in SHIPPED}
    assert {"sandbox-proof.yaml", "exit-codes.yaml", "file-roundtrip.yaml", "smoke.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_file_validates(path: Path, tmp_path: Path) -> None:
    settings = Settings.load(state_dir=tmp_path / "state")
    item = load_any(path)
    for recipe in iter_recipes(item):
        model = recipe.model or settings.default_model
        if model.startswith("replay/"):
            assert (settings.cassettes_dir / f"{model.removeprefix('replay/')}.json").is_file()
        validate_recipe(recipe, settings)
        assert expand(recipe, default_model=settings.default_model)


def test_product_page_sample() -> None:
    [run] = expand(load_recipe(REPO / "recipes/sandbox-proof.yaml"), default_model="unused/model")
    assert run.prompt == PAGE_PROMPT
    assert run.model == "replay/sandbox-proof"
    assert run.policy.model_dump() == {
        "web": False,
        "shell": True,
        "files": [],
        "connections": [],
        "zero_data_retention": False,
        "timeout_seconds": 120,
        "max_cost_micros": 40000,
        "isolation": "auto",
        "image": None,
        "disk_mib": None,
        "setup": [],
        "verify": [],
        "verify_timeout_seconds": None,
        "verify_files": [],
        "models": [],
        "agent": None,
    }


def test_smoke_suite_runs_three_offline_recipes() -> None:
    suite = load_suite(REPO / "recipes/suites/smoke.yaml")
    assert suite.name == "smoke"
    names = [r.name for r in suite.loaded_recipes]
    assert names == ["sandbox-proof", "exit-codes", "file-roundtrip"]
    assert all((r.model or "").startswith("replay/") for r in suite.loaded_recipes)
    assert suite.gates.min_pass_rate == 1.0
    assert suite.concurrency == 2
