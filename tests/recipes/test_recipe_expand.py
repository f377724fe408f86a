"""Expansion: matrix x repeat in a fixed order, prompts rendered per cell, worst case summed."""

from __future__ import annotations

from pathlib import Path

import pytest

from ephemeral.errors import RecipeError
from ephemeral.policy import Policy
from ephemeral.recipes.recipe import PlannedRun, Recipe, expand, load_recipe, worst_case_micros

from .helpers import write

MATRIX = """
    name: grid
    model: replay/sandbox-proof
    prompt: "{{ greeting }} from {{ os }}/{{ arch }} #{{ repeat_index }}"
    vars: {greeting: hi}
    matrix:
      os: [linux, freebsd]
      arch: [x86_64, arm64, riscv64]
    repeat: 2
    policy: {max_cost_micros: 30000}
    budget_micros: 100000
"""


def test_matrix_times_repeat_in_file_order(tmp_path: Path) -> None:
    runs = expand(load_recipe(write(tmp_path, MATRIX)), default_model="openai/gpt-6-luna")
    assert len(runs) == 2 * 3 * 2
    assert [(r.cell["os"], r.cell["arch"], r.repeat_index) for r in runs[:7]] == [
        ("linux", "x86_64", 0),
        ("linux", "x86_64", 1),
        ("linux", "arm64", 0),
        ("linux", "arm64", 1),
        ("linux", "riscv64", 0),
        ("linux", "riscv64", 1),
        ("freebsd", "x86_64", 0),
    ]
    assert runs[3].prompt == "hi from linux/arm64 #1"
    assert {r.model for r in runs} == {"replay/sandbox-proof"}
    assert {r.recipe for r in runs} == {"grid"}
    assert all(r.policy.max_cost_micros == 30000 for r in runs)
    assert worst_case_micros(runs) == 12 * 30000


def test_key_order_follows_the_file(tmp_path: Path) -> None:
    text = MATRIX.replace(
        "os: [linux, freebsd]\n      arch: [x86_64, arm64, riscv64]",
        "arch: [x86_64, arm64, riscv64]\n      os: [linux, freebsd]",
    )
    runs = expand(load_recipe(write(tmp_path, text)), default_model="x/y")
    assert list(runs[0].cell) == ["arch", "os"]
    assert [r.cell["os"] for r in runs[:4]] == ["linux", "linux", "freebsd", "freebsd"]


def test_no_matrix_is_one_cell(tmp_path: Path) -> None:
    path = write(tmp_path, "name: one\nprompt: run {{ repeat_index }}\nrepeat: 3\n")
    runs = expand(load_recipe(path), default_model="replay/sandbox-proof")
    assert [(r.cell, r.repeat_index, r.prompt) for r in runs] == [
        ({}, 0, "run 0"),
        ({}, 1, "run 1"),
        ({}, 2, "run 2"),
    ]
    assert {r.model for r in runs} == {"replay/sandbox-proof"}  # the default
    assert worst_case_micros(runs) == 3 * Policy().max_cost_micros


def test_structured_matrix_values_render_and_pair(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: structured
        prompt: "Use {{ tool.name }} at version {{ tool.version }}"
        matrix:
          tool:
            - {name: curl, version: 8}
            - {name: wget, version: 1}
    """,
    )
    runs = expand(load_recipe(path), default_model="x/y")
    assert [r.prompt for r in runs] == ["Use curl at version 8", "Use wget at version 1"]
    keys = [r.pair_key() for r in runs]
    assert len(set(keys)) == 2
    again = expand(load_recipe(path), default_model="x/y")
    assert [r.pair_key() for r in again] == keys


def test_planned_run_round_trips_as_json(tmp_path: Path) -> None:
    runs = expand(load_recipe(write(tmp_path, MATRIX)), default_model="x/y")
    dumped = [r.model_dump(mode="json") for r in runs]
    assert [PlannedRun.model_validate(d) for d in dumped] == runs


def test_expand_of_a_python_recipe() -> None:
    recipe = Recipe(name="py", prompt="{{ n }} + 1", vars={"n": 41}, repeat=2)
    runs = expand(recipe, default_model="replay/sandbox-proof")
    assert [r.prompt for r in runs] == ["41 + 1", "41 + 1"]


def test_expand_refuses_bad_names_in_a_python_recipe() -> None:
    recipe = Recipe(name="py", prompt="{{ a }}", vars={"a": 1}, matrix={"a": [2]})
    with pytest.raises(RecipeError) as info:
        expand(recipe, default_model="x/y")
    assert [e["field"] for e in info.value.errors or []] == ["matrix.a"]
