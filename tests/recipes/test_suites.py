"""Suites: recipes named relative to the suite file, loaded with the same error quality."""

from __future__ import annotations

from pathlib import Path

import pytest

from ephemeral.errors import RecipeError
from ephemeral.recipes.recipe import Recipe, Suite, load_any, load_suite

from .helpers import write

RECIPE = "name: {name}\nprompt: hi\npolicy: {{max_cost_micros: 30000}}\n"


def suite_errors(path: Path) -> list[dict[str, object]]:
    with pytest.raises(RecipeError) as info:
        load_suite(path)
    return info.value.errors or []


def test_suite_loads_its_recipes_in_order(tmp_path: Path) -> None:
    write(tmp_path, RECIPE.format(name="a"), "a.yaml")
    write(tmp_path, RECIPE.format(name="b"), "more/b.yaml")
    path = write(
        tmp_path,
        """
        name: nightly
        recipes: [../a.yaml, ../more/b.yaml]
        budget: {max_cost_micros: 100000}
        gates: {min_pass_rate: 0.9}
        concurrency: 3
    """,
        "suites/nightly.yaml",
    )
    suite = load_suite(path)
    assert [r.name for r in suite.loaded_recipes] == ["a", "b"]
    assert [r.source_file for r in suite.loaded_recipes] == [
        str(tmp_path / "a.yaml"),
        str(tmp_path / "more/b.yaml"),
    ]
    assert (suite.budget_micros, suite.gates.min_pass_rate, suite.concurrency) == (100000, 0.9, 3)
    assert isinstance(load_any(path), Suite)
    assert isinstance(load_any(tmp_path / "a.yaml"), Recipe)


def test_suite_defaults(tmp_path: Path) -> None:
    write(tmp_path, RECIPE.format(name="a"), "a.yaml")
    suite = load_suite(write(tmp_path, "name: s\nrecipes: [a.yaml]\n", "s.yaml"))
    assert (suite.budget_micros, suite.gates.min_pass_rate, suite.concurrency) == (None, 1.0, 2)


def test_missing_and_broken_recipes_name_their_own_files(tmp_path: Path) -> None:
    write(tmp_path, RECIPE.format(name="a"), "a.yaml")
    write(tmp_path, "name: b\nprompt: |\n  {{ nope }}\n", "b.yaml")
    path = write(
        tmp_path,
        """
        name: s
        recipes:
          - a.yaml
          - gone.yaml
          - b.yaml
    """,
        "s.yaml",
    )
    errors = suite_errors(path)
    gone = next(e for e in errors if e["field"] == "recipes[1]")
    assert (gone["file"], gone["line"]) == (str(path), 4)
    assert "no recipe file" in str(gone["message"])
    broken = next(e for e in errors if e["file"] == str(tmp_path / "b.yaml"))
    assert (broken["field"], broken["line"]) == ("prompt", 3)


def test_duplicate_names_and_small_budget(tmp_path: Path) -> None:
    write(tmp_path, RECIPE.format(name="same"), "a.yaml")
    write(tmp_path, RECIPE.format(name="same"), "b.yaml")
    path = write(
        tmp_path,
        """
        name: s
        recipes: [a.yaml, b.yaml]
        budget_micros: 1000
    """,
        "s.yaml",
    )
    errors = suite_errors(path)
    dup = next(e for e in errors if e["field"] == "recipes[1]")
    assert "also recipes[0]" in str(dup["message"])
    assert dup["line"] == 2
    budget = next(e for e in errors if e["field"] == "budget_micros")
    assert budget["line"] == 3
    assert "could never start" in str(budget["message"])


def test_suite_schema_errors(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: s
        recipes: []
        gates: {min_pass_rate: 1.5, max_fail: 2}
        concurrency: 0
    """,
        "s.yaml",
    )
    fields = {str(e["field"]): e["line"] for e in suite_errors(path)}
    assert fields == {"recipes": 2, "gates.min_pass_rate": 3, "gates.max_fail": 3, "concurrency": 4}
