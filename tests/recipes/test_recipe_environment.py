"""Recipe fields for the run's environment and its cells: image, setup/verify, files_from,
dataset (+ filter, sample, limit) and the models axis. Errors name the file, line and field."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from ephemeral.errors import InvalidRequest
from ephemeral.recipes import datasets
from ephemeral.recipes.checks import evaluate
from ephemeral.recipes.recipe import expand, iter_planned, load_recipe
from tests.recipes.helpers import recipe_errors, write

BASE = """
name: env
model: x/y
prompt: "fix {{ function }}"
policy: {timeout_seconds: 60, max_cost_micros: 1000}
"""


def _rows(tmp_path: Path, rows: list[dict], name: str = "rows.jsonl") -> None:
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_setup_verify_image_and_files_from_reach_every_planned_run(tmp_path: Path) -> None:
    (tmp_path / "proj" / "pkg").mkdir(parents=True)
    (tmp_path / "proj" / "pkg" / "a.py").write_text("A = 1\n")
    (tmp_path / "proj" / "pkg" / "__pycache__").mkdir()
    (tmp_path / "proj" / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"x")
    _rows(tmp_path, [{"function": "add"}, {"function": "sub"}])
    path = write(
        tmp_path,
        BASE
        + """
image: python-dev
files_from: proj
dataset: rows.jsonl
setup: ["echo {{ function }} > which.txt"]
verify: ["grep -q {{ function }} which.txt", "true"]
verify_timeout_seconds: 10
""",
    )
    runs = expand(load_recipe(path), default_model="unused/m")
    assert [r.cell for r in runs] == [{"function": "add"}, {"function": "sub"}]
    assert [r.prompt for r in runs] == ["fix add", "fix sub"]
    assert [r.policy.setup for r in runs] == [
        ["echo add > which.txt"],
        ["echo sub > which.txt"],
    ]
    assert runs[1].policy.verify == ["grep -q sub which.txt", "true"]
    for r in runs:
        assert r.policy.image == "python-dev" and r.policy.verify_timeout_seconds == 10
        assert [(f.path, f.data()) for f in r.policy.files] == [("pkg/a.py", b"A = 1\n")]


@pytest.mark.parametrize(
    ("extra", "field", "line", "message"),
    [
        ("files_from: nowhere\n", "files_from", 5, "no directory"),
        ("image: Not_An_Image\n", "image", 5, "must be lowercase"),
        ("verify: [x]\nverify_timeout_seconds: 60\n", "verify_timeout_seconds", 6, "less than"),
        ("setup: ['{{ nope }}']\n", "setup[0]", 5, "'nope' is undefined"),
        ("verify: ['{% if %}']\n", "verify[0]", 5, "template syntax"),
        ("dataset_limit: 3\n", "dataset_limit", 5, "needs dataset:"),
        ("models: [a/b]\n", "models", 5, "give model or models, not both"),
    ],
)
def test_environment_errors_name_file_line_and_field(
    tmp_path: Path, extra: str, field: str, line: int, message: str
) -> None:
    text = BASE.replace('"fix {{ function }}"', '"fix it"') + extra
    errors = recipe_errors(write(tmp_path, text))
    assert errors[0]["field"] == field, errors
    assert errors[0]["line"] == line, errors
    assert message in errors[0]["message"], errors


def test_environment_fields_belong_at_the_top_level(tmp_path: Path) -> None:
    text = BASE.replace("max_cost_micros: 1000}", "max_cost_micros: 1000, image: python-dev}")
    [err] = recipe_errors(write(tmp_path, text.replace("{{ function }}", "it")))
    assert (err["field"], err["line"]) == ("policy.image", 4)
    assert "top level" in err["message"]


def test_files_from_is_held_to_the_run_limits(tmp_path: Path) -> None:
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "huge.bin").write_bytes(b"\0" * ((1 << 20) + 1))
    text = BASE.replace("{{ function }}", "it") + "files_from: big\n"
    [err] = recipe_errors(write(tmp_path, text))
    assert (err["field"], err["line"]) == ("files_from", 5)
    assert "huge.bin" in err["message"] and "per file" in err["message"]


# ---------------------------------------------------------------- datasets


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_each_format_is_read_by_duckdb_in_file_order(tmp_path: Path, fmt: str) -> None:
    import duckdb

    rows = [{"function": f"f{i}", "n": i} for i in range(5)]
    _rows(tmp_path, rows, "src.jsonl")
    if fmt != "jsonl":
        options = "(HEADER)" if fmt == "csv" else "(FORMAT parquet)"
        duckdb.execute(
            f"COPY (SELECT * FROM read_json('{tmp_path / 'src.jsonl'}')) "
            f"TO '{tmp_path / f'rows.{fmt}'}' {options}"
        )
    else:
        (tmp_path / "src.jsonl").rename(tmp_path / "rows.jsonl")
    recipe = load_recipe(write(tmp_path, BASE + f"dataset: rows.{fmt}\n"))
    assert recipe.run_count() == 5
    cells = [r.cell for r in iter_planned(recipe, default_model="m/x")]
    assert cells == rows


def test_filter_sample_and_limit_select_rows(tmp_path: Path) -> None:
    _rows(tmp_path, [{"function": f"f{i}", "n": i} for i in range(100)])

    def cells(extra: str) -> list[int]:
        recipe = load_recipe(write(tmp_path, BASE + "dataset: rows.jsonl\n" + extra))
        return [r.cell["n"] for r in iter_planned(recipe, default_model="m/x")]

    assert cells("dataset_filter: n % 10 = 3\n") == [3, 13, 23, 33, 43, 53, 63, 73, 83, 93]
    assert cells("dataset_filter: n >= 90\ndataset_limit: 3\n") == [90, 91, 92]
    sampled = cells("dataset_sample: {n: 7, seed: 42}\n")
    assert len(sampled) == 7 and sampled == sorted(sampled)  # picked rows keep file order
    assert cells("dataset_sample: {n: 7, seed: 42}\n") == sampled  # same seed, same rows
    assert cells("dataset_sample: {n: 7, seed: 43}\n") != sampled


@pytest.mark.parametrize(
    "predicate",
    [
        "n > 1; DROP TABLE ds",
        "n > (SELECT count(*) FROM read_csv('/etc/passwd'))",
        "n > 1 -- comment",
        # closing the parenthesis to add rows or clauses (issue 18)
        "n = 2) UNION SELECT * FROM ds WHERE (true",
        "n = 2) UNION ALL (SELECT * FROM ds",
        "n = 2) OR (n IN (SELECT n FROM ds)",
        "true) ORDER BY (n",
        "true) LIMIT (1",
        "true) GROUP BY ALL HAVING (true",
        "true) QUALIFY (true",
        "true) USING SAMPLE (1",
        "EXISTS (FROM read_csv('rows.jsonl'))",
        "length(read_text('/etc/passwd')) > 0",
        "getenv('HOME') IS NOT NULL",
        "current_setting('threads') > 0",
        "n = 2)",
    ],
)
def test_a_filter_is_a_predicate_without_side_effects(tmp_path: Path, predicate: str) -> None:
    _rows(tmp_path, [{"function": "f", "n": 1}])
    text = BASE + f"dataset: rows.jsonl\ndataset_filter: {json.dumps(predicate)}\n"
    [err] = recipe_errors(write(tmp_path, text))
    assert (err["field"], err["line"]) == ("dataset_filter", 6), err


def test_the_filter_that_runs_is_the_parsed_predicate() -> None:
    assert datasets.check_filter("n % 10 = 3 and kind = 'a'") == (
        "SELECT * FROM ds WHERE (((n % 10) = 3) AND (kind = 'a'))"
    )
    with pytest.raises(InvalidRequest) as info:
        datasets.check_filter("n = 2) UNION SELECT * FROM ds WHERE (true")
    assert info.value.errors == [
        {
            "field": "dataset_filter",
            "message": "must be one SQL predicate (it closes its parenthesis to add a clause)",
        }
    ]


def test_dataset_errors_name_the_file_and_row(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text('{"function": "a"}\n{"function": \n')
    [err] = recipe_errors(write(tmp_path, BASE + "dataset: rows.jsonl\n"))
    assert (err["field"], err["line"]) == ("dataset", 5)
    assert str(tmp_path / "rows.jsonl") in err["message"]
    assert "Malformed JSON" in err["message"] and " line " in err["message"], err

    _rows(tmp_path, [{"x": 1}, {"x": 2}])
    [err] = recipe_errors(write(tmp_path, BASE + "dataset: rows.jsonl\n"))
    assert "dataset rows.jsonl row 1" in err["message"] and "function" in err["message"]


def test_dataset_columns_must_be_free_identifiers(tmp_path: Path) -> None:
    _rows(tmp_path, [{"function": "a", "bad name": 1, "repeat_index": 2}])
    errors = recipe_errors(write(tmp_path, BASE + "dataset: rows.jsonl\n"))
    messages = " | ".join(e["message"] for e in errors)
    assert "'bad name' is not an identifier" in messages
    assert "'repeat_index' is also a variable" in messages


def test_models_axis_runs_every_cell_on_each_model(tmp_path: Path) -> None:
    _rows(tmp_path, [{"function": "a"}, {"function": "b"}])
    text = BASE.replace("model: x/y\n", "") + "dataset: rows.jsonl\nmodels: [p/one, p/two]\n"
    runs = expand(load_recipe(write(tmp_path, text)), default_model="unused/m")
    assert [(r.cell["function"], r.model) for r in runs] == [
        ("a", "p/one"),
        ("a", "p/two"),
        ("b", "p/one"),
        ("b", "p/two"),
    ]
    assert runs[1].cell == {"function": "a", "model": "p/two"}
    assert len({r.pair_key() for r in runs}) == 4


# ---------------------------------------------------------------- the verify check


def _verify_event(command: str, code: int | None, stdout: str = "", **kw: object) -> dict:
    data = {"command": command, "exit_code": code, "stdout": stdout, "stderr": "", **kw}
    return {"type": "verify.executed", "data": data}


def test_verify_check_judges_the_graders_results(tmp_path: Path) -> None:
    text = BASE.replace("{{ function }}", "it") + (
        "verify: [pytest -q, 'true']\n"
        "checks:\n"
        "  - verify: {exit_code: 0}\n"
        "  - verify: {command_matches: pytest, stdout_contains: 3 passed}\n"
    )
    checks = load_recipe(write(tmp_path, text)).checks
    run = {"status": "succeeded"}
    ok = [_verify_event("pytest -q", 0, "3 passed in 0.1s"), _verify_event("true", 0)]
    assert [r.passed for r in evaluate(checks, run, ok)] == [True, True]
    bad = [_verify_event("pytest -q", 1, "1 failed, 2 passed"), _verify_event("true", 0)]
    results = evaluate(checks, run, bad)
    assert [r.passed for r in results] == [False, False]
    assert results[0].reason == "'pytest -q': exit code 1, wanted 0"
    assert "lacks '3 passed'" in results[1].reason
    killed = [_verify_event("pytest -q", None, timed_out=True)]
    assert evaluate(checks[:1], run, killed)[0].reason == (
        "'pytest -q': killed at its deadline, wanted 0"
    )
    skipped = [_verify_event("pytest -q", None, skipped="no time or budget left")]
    assert "did not run: no time or budget left" in evaluate(checks[:1], run, skipped)[0].reason
    assert evaluate(checks, run, [])[0].reason == "no verify command ran"
    zdr = [{"type": "verify.executed", "data": {"command_bytes": 9, "exit_code": 0}}]
    assert [r.passed for r in evaluate(checks, run, zdr)] == [True, False]


def test_b64_of_files_from_round_trips(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "bin").write_bytes(bytes(range(256)))
    recipe = load_recipe(write(tmp_path, BASE.replace("{{ function }}", "x") + "files_from: d\n"))
    [f] = recipe.run_policy.files
    assert base64.b64decode(f.content_base64) == bytes(range(256))


# ---------------------------------------------------------------- output_json_schema


def test_output_json_schema_validates_the_output_or_its_code_block(tmp_path: Path) -> None:
    text = BASE.replace("{{ function }}", "it") + (
        "checks:\n"
        "  - output_json_schema:\n"
        "      title: answer\n"
        "      type: object\n"
        "      required: [answer]\n"
        "      properties: {answer: {type: integer}}\n"
    )
    [check] = load_recipe(write(tmp_path, text)).checks
    assert check.label() == "output_json_schema: answer"

    def judge(output: str | None) -> tuple[bool, str]:
        [r] = evaluate([check], {"output": output}, [])
        return r.passed, r.reason

    assert judge('{"answer": 42}') == (True, "the output is valid against the schema")
    fenced = 'Here it is:\n```json\n{"answer": 7}\n```\n'
    assert judge(fenced) == (True, "the output's first code block is valid against the schema")
    ok, why = judge('{"answer": "42"}')
    assert not ok and why.startswith("the output fails the schema at answer: '42' is not of")
    ok, why = judge("{}")
    assert not ok and "'answer' is a required property" in why
    assert judge("no json here")[1].startswith("the output is not JSON")
    assert judge(None) == (False, "the run has no output")


def test_an_invalid_json_schema_is_a_recipe_error(tmp_path: Path) -> None:
    text = BASE.replace("{{ function }}", "it") + (
        "checks:\n  - output_json_schema: {type: not-a-type}\n"
    )
    [err] = recipe_errors(write(tmp_path, text))
    assert err["field"] == "checks[0].output_json_schema" and err["line"] == 6
    assert "not a valid JSON Schema" in err["message"]


def test_the_pass_table_has_one_row_per_model(tmp_path: Path) -> None:
    from ephemeral.evals.result import RunResult
    from ephemeral.evals.stats import gate_failures, recipe_stats

    text = BASE.replace("model: x/y\n", "").replace("{{ function }}", "it")
    recipe = load_recipe(write(tmp_path, text + "models: [p/one, p/two]\n"))
    results = [
        RunResult(pair_key=f"k{i}", recipe="env", cell={"model": m}, run_id=f"r{i}", status=s)
        for i, (m, s) in enumerate([("p/one", "succeeded"), ("p/two", "failed")])
    ]
    stats = recipe_stats([recipe], results)
    assert [(s.recipe, s.model, s.passed, s.planned) for s in stats] == [
        ("env [p/one]", "p/one", 1, 1),
        ("env [p/two]", "p/two", 0, 1),
    ]
    assert gate_failures(stats, 1.0) == [
        "env [p/two]: pass rate 0% (0/1 graded) below min_pass_rate 100%"
    ]
