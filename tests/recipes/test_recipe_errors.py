"""Every kind of recipe error names the file, the line and the field; all are reported at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from ephemeral.errors import RecipeError
from ephemeral.recipes.recipe import Recipe, expand, load_recipe

from .helpers import only, recipe_errors, write


def test_good_recipe_loads(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: ok
        prompt: Say hi to {{ who }}.
        vars: {who: worker}
    """,
    )
    recipe = load_recipe(path)
    assert recipe.name == "ok"
    assert recipe.source_file == str(path)


def test_yaml_syntax_error_has_its_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: broken
        prompt: hello
        policy:
          web: false
         shell: true
    """,
    )
    [err] = recipe_errors(path)
    assert err["field"] == "yaml"
    assert err["line"] == 5
    assert err["message"]


def test_unclosed_flow_sequence(tmp_path: Path) -> None:
    path = write(tmp_path, 'name: x\nprompt: "a"\nmatrix:\n  os: [linux, mac\n')
    [err] = recipe_errors(path)
    assert (err["field"], err["line"]) == ("yaml", 5)


def test_unknown_key_suggests_the_right_one(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: typo
        descripton: oops
        prompt: hi
    """,
    )
    err = only(recipe_errors(path), "descripton")
    assert err["line"] == 2
    assert "unknown field" in err["message"]
    assert "'description'" in err["message"]


def test_labels_are_bounded_and_the_runners_names_reserved(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: labelled
        prompt: hi
        labels:
          team: evals
          suite_run_id: suite_forged
    """,
    )
    err = only(recipe_errors(path), "labels")
    assert "'suite_run_id' reserved" in err["message"]
    path.write_text(path.read_text().replace("  suite_run_id: suite_forged\n", ""))
    assert load_recipe(path).labels == {"team": "evals"}


def test_unknown_policy_key(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: typo
        prompt: hi
        policy:
          shell: true
          network: true
    """,
    )
    err = only(recipe_errors(path), "policy.network")
    assert err["line"] == 5


def test_wrong_type(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: types
        prompt: hi
        repeat: many
    """,
    )
    err = only(recipe_errors(path), "repeat")
    assert err["line"] == 3
    assert "integer" in err["message"]


def test_bad_policy_values(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: policy
        prompt: hi
        policy:
          web: false
          timeout_seconds: 99999
          isolation: vm-please
          files:
            - path: /etc/passwd
              content_base64: "aGk="
    """,
    )
    errors = recipe_errors(path)
    assert only(errors, "policy.timeout_seconds")["line"] == 5
    assert "3600" in only(errors, "policy.timeout_seconds")["message"]
    assert only(errors, "policy.isolation")["line"] == 6
    files = only(errors, "policy.files[0].path")
    assert files["line"] == 8
    assert "relative" in files["message"]


def test_missing_required_field(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: no-prompt
        vars: {}
    """,
    )
    err = only(recipe_errors(path), "prompt")
    assert err["message"] == "required"
    assert err["line"] == 1


def test_template_undefined_variable_points_at_its_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: undefined
        vars:
          who: worker
        prompt: |
          Line one for {{ who }}.
          Line two uses {{ whom }}.
    """,
    )
    err = only(recipe_errors(path), "prompt")
    assert "'whom' is undefined" in err["message"]
    assert err["line"] == 6


def test_template_undefined_in_a_plain_scalar(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: undefined
        prompt: "Hello {{ nobody }}"
    """,
    )
    err = only(recipe_errors(path), "prompt")
    assert err["line"] == 2


def test_template_syntax_error_points_at_its_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: syntax
        prompt: |
          first line
          second line
          {% if %}oops{% endif %}
    """,
    )
    err = only(recipe_errors(path), "prompt")
    assert err["message"].startswith("template syntax:")
    assert err["line"] == 5


def test_undefined_only_in_some_cells_names_the_cell(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: cells
        prompt: "{{ data[lang] }}"
        vars:
          data: {python: print}
        matrix:
          lang: [python, rust]
    """,
    )
    err = only(recipe_errors(path), "prompt")
    assert "rust" in err["message"]
    assert '"lang": "rust"' in err["message"]


def test_bad_regex_in_checks(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: regex
        prompt: hi
        checks:
          - output_contains: fine
          - output_matches: "(unclosed"
          - shell: {command_matches: "[z-a]"}
    """,
    )
    errors = recipe_errors(path)
    err = only(errors, "checks[1].output_matches")
    assert err["line"] == 5
    assert "regular expression" in err["message"]
    assert only(errors, "checks[2].shell.command_matches")["line"] == 6


def test_check_shapes(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: shapes
        prompt: hi
        checks:
          - output_contains: a
            status: succeeded
          - smells_good: true
          - shell: {command_matches: curl, exit_code: 0, exit_code_not: 0}
          - status: running
          - max_cost_micros: -5
          - "output_contains"
    """,
    )
    errors = recipe_errors(path)
    assert "exactly one key" in only(errors, "checks[0]")["message"]
    assert only(errors, "checks[0]")["line"] == 4
    assert only(errors, "checks[1]")["line"] == 6
    assert "not both" in only(errors, "checks[2].shell")["message"]
    assert only(errors, "checks[3].status")["line"] == 8
    assert only(errors, "checks[4].max_cost_micros")["line"] == 9
    assert only(errors, "checks[5]")["line"] == 10


def test_empty_matrix_list(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: matrix
        prompt: "{{ os }} {{ arch }}"
        matrix:
          os: [linux]
          arch: []
    """,
    )
    err = only(recipe_errors(path), "matrix.arch")
    assert err["line"] == 5
    assert "at least 1" in err["message"]


def test_matrix_and_vars_names(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: names
        prompt: hi
        vars:
          not-an-identifier: 1
          shared: 2
        matrix:
          shared: [a]
          repeat_index: [0]
    """,
    )
    errors = recipe_errors(path)
    assert only(errors, "vars.not-an-identifier")["line"] == 4
    assert "also defined in vars" in only(errors, "matrix.shared")["message"]
    assert only(errors, "matrix.shared")["line"] == 7
    assert only(errors, "matrix.repeat_index")["line"] == 8


def test_too_many_runs(tmp_path: Path) -> None:
    hundred = list(range(100))
    text = (
        'name: big\nprompt: "{{ a }}{{ b }}"\nmatrix:\n'
        f"  a: {hundred}\n  b: {hundred}\nrepeat: 101\n"
    )
    path = write(tmp_path, text)
    err = only(recipe_errors(path), "matrix")
    assert "1010000 runs, more than 1000000" in err["message"]
    assert err["line"] == 3


def test_duplicate_key(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: dup
        prompt: hi
        name: dup2
    """,
    )
    err = only(recipe_errors(path), "name")
    assert err["line"] == 3
    assert "first at line 1" in err["message"]


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: Not A Name
        model: no-slash
        prompt: hi
        repeat: 0
        policy: {timeout_seconds: 0, max_cost_micros: 0}
        checks:
          - status: maybe
    """,
    )
    errors = recipe_errors(path)
    fields = {e["field"]: e["line"] for e in errors}
    assert fields == {
        "name": 1,
        "model": 2,
        "repeat": 4,
        "policy.timeout_seconds": 5,
        "policy.max_cost_micros": 5,
        "checks[0].status": 7,
    }
    assert [e["line"] for e in errors] == sorted(e["line"] for e in errors)


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        ("budget_micros: 200000", 200000),
        ("budget: 150000", 150000),
        ("budget: {max_cost_micros: 120000}", 120000),
    ],
)
def test_budget_spellings(tmp_path: Path, budget: str, expected: int) -> None:
    path = write(tmp_path, f"name: b\nprompt: hi\n{budget}\n")
    assert load_recipe(path).budget_micros == expected


def test_budget_errors(tmp_path: Path) -> None:
    both = write(tmp_path, "name: b\nprompt: hi\nbudget: 1\nbudget_micros: 100000\n", "both.yaml")
    assert "give one" in only(recipe_errors(both), "budget")["message"]
    shape = write(tmp_path, "name: b\nprompt: hi\nbudget: {usd: 1}\n", "shape.yaml")
    err = only(recipe_errors(shape), "budget")
    assert (err["line"], "max_cost_micros" in err["message"]) == (3, True)
    small = write(
        tmp_path,
        "name: b\nprompt: hi\nbudget: 1000\npolicy: {max_cost_micros: 40000}\n",
        "small.yaml",
    )
    err = only(recipe_errors(small), "budget_micros")
    assert err["line"] == 3
    assert "no run could start" in err["message"]


def test_file_level_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    [err] = recipe_errors(missing)
    assert (err["field"], err["line"]) == ("(root)", 0)
    assert "cannot read" in err["message"]
    listing = write(tmp_path, "- name: x\n", "list.yaml")
    [err] = recipe_errors(listing)
    assert (err["field"], err["line"]) == ("(root)", 1)
    empty = write(tmp_path, "", "empty.yaml")
    [err] = recipe_errors(empty)
    assert "mapping" in err["message"]
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"name: \xff\xfe\n")
    [err] = recipe_errors(binary)
    assert "UTF-8" in err["message"]


def test_empty_rendered_prompt(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: empty
        prompt: "{{ nothing }}"
        vars: {nothing: "   "}
    """,
    )
    assert "empty prompt" in only(recipe_errors(path), "prompt")["message"]


@pytest.mark.parametrize(
    "expr",
    [
        "''.__class__",
        "''.__class__.__mro__[1].__subclasses__()",
        "self.__init__.__globals__",
        "cycler.__init__.__globals__.os",
        "items.append(4)",
        "'x' * 10000000",
        "2 ** 100000",
    ],
)
def test_sandbox_refuses_escapes_and_blowups(tmp_path: Path, expr: str) -> None:
    text = f"name: escape\nprompt: |\n  hello\n  {{{{ {expr} }}}}\nvars: {{items: [1]}}\n"
    path = write(tmp_path, text)
    err = only(recipe_errors(path), "prompt")
    assert err["message"].startswith("template")
    assert err["line"] == 4, err


def test_expand_reports_problems_of_an_in_memory_recipe() -> None:
    recipe = Recipe(name="mem", prompt="{{ ghost }}")
    with pytest.raises(RecipeError) as info:
        expand(recipe, default_model="replay/sandbox-proof")
    [err] = info.value.errors or []
    assert err["file"] == "<recipe mem>"
    assert err["field"] == "prompt"


def _bomb(levels: int) -> str:
    lines = [
        "name: bomb",
        f'prompt: "{{{{ l{levels - 1} }}}}"',
        "vars:",
        "  l0: &a0 [x, x, x, x, x, x, x, x, x, x]",
    ]
    for n in range(1, levels):
        lines.append(f"  l{n}: &a{n} [" + ", ".join([f"*a{n - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text",
    [
        _bomb(9),  # a billion laughs: 10**9 values from a 1 KiB file
        "name: rec\nprompt: hi\nvars:\n  r: &r [*r]\n",  # an anchor that contains itself
        "name: deep\nprompt: hi\nvars:\n  v: " + "[" * 200 + "]" * 200 + "\n",
    ],
    ids=["alias-bomb", "recursive-anchor", "deep-nesting"],
)
def test_hostile_yaml_is_refused_quickly(tmp_path: Path, text: str) -> None:
    [err] = recipe_errors(write(tmp_path, text))
    assert (err["field"], err["line"]) == ("(root)", 1)
    assert "expands to more than" in err["message"]


def test_aliases_within_limits_still_work(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: shared
        prompt: "{{ a | length }} {{ b | length }}"
        vars:
          a: &files [one, two]
          b: *files
    """,
    )
    [run] = expand(load_recipe(path), default_model="x/y")
    assert run.prompt == "2 2"


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("  web: 'yes'", "policy.web"),
        ("  shell: 1", "policy.shell"),
        ("  timeout_seconds: '30'", "policy.timeout_seconds"),
        ("  max_cost_micros: 1.5", "policy.max_cost_micros"),
        ("  zero_data_retention: null", "policy.zero_data_retention"),
    ],
)
def test_policy_values_are_not_coerced(tmp_path: Path, line: str, field: str) -> None:
    path = write(tmp_path, f"name: strict\nprompt: hi\npolicy:\n{line}\n")
    err = only(recipe_errors(path), field)
    assert err["line"] == 4


def test_duplicate_file_path_names_the_second_item_and_its_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        name: dup
        prompt: hi
        policy:
          files:
            - {path: a.txt, content_base64: ""}
            - {path: a.txt, content_base64: ""}
    """,
    )
    err = only(recipe_errors(path), "policy.files[1].path")
    assert err["line"] == 6 and "duplicate path" in err["message"]
