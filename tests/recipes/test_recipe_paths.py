"""files_from and dataset stay inside the recipe's directory: absolute paths, `..` and symlinks
out are errors naming the field, the file and its line (issue 18)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ephemeral.errors import InvalidRequest
from ephemeral.recipes.recipe import confined_path, files_under, load_recipe
from tests.recipes.helpers import only, recipe_errors, write

LINK = "a symbolic link (nothing is read through a link, in or out of the directory)"
BASE = """
name: paths
model: x/y
prompt: "hello"
policy: {timeout_seconds: 60, max_cost_micros: 1000}
"""


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the recipe's, with a secret file and a dataset in it."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.txt").write_text("host secret\n")
    (out / "rows.jsonl").write_text('{"a": 1}\n')
    return out


def _recipe(tmp_path: Path, extra: str) -> Path:
    return write(tmp_path / "recipe", BASE + extra)


@pytest.mark.parametrize("field", ["files_from", "dataset"])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{outside}", "must be a path relative to"),
        ("../outside", "must not contain '..'"),
        ("sub/../../outside", "must not contain '..'"),
        ("link", "link"),  # files_from: "a symbolic link"; dataset: "outside ... (symlink)"
        ("inner/link", "link"),
    ],
)
def test_paths_out_of_the_recipe_directory_are_refused(
    tmp_path: Path, outside: Path, field: str, value: str, message: str
) -> None:
    target = outside if field == "files_from" else outside / "rows.jsonl"
    (tmp_path / "recipe" / "inner").mkdir(parents=True)
    os.symlink(target, tmp_path / "recipe" / "link")
    os.symlink(target, tmp_path / "recipe" / "inner" / "link")
    path = _recipe(tmp_path, f"\n{field}: {value.format(outside=target)}\n")
    err = only(recipe_errors(path), field)
    assert message in err["message"]
    assert err["line"] == 6


def test_a_symlink_inside_a_files_from_tree_is_refused(tmp_path: Path, outside: Path) -> None:
    tree = tmp_path / "recipe" / "proj"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "a.py").write_text("A = 1\n")
    os.symlink(outside / "secret.txt", tree / "pkg" / "secret.txt")
    err = only(recipe_errors(_recipe(tmp_path, "files_from: proj\n")), "files_from")
    assert err["message"] == f"pkg/secret.txt: {LINK}"
    (tree / "pkg" / "secret.txt").unlink()
    os.symlink(outside, tree / "pkg" / "dir")  # a directory link is refused, not skipped
    err = only(recipe_errors(_recipe(tmp_path, "files_from: proj\n")), "files_from")
    assert err["message"] == f"pkg/dir: {LINK}"


def test_a_files_from_directory_reached_through_a_link_is_refused(tmp_path: Path) -> None:
    """Even a link that stays inside: the directory named is read as it is, never through one
    (issue 35: files go in only from inside the recipe's directory, a link is refused naming it)."""
    root = tmp_path / "recipe"
    (root / "real" / "proj").mkdir(parents=True)
    (root / "real" / "proj" / "a.py").write_text("A = 1\n")
    os.symlink("real", root / "alias")
    err = only(recipe_errors(_recipe(tmp_path, "files_from: alias/proj\n")), "files_from")
    assert err["message"] == f"alias: {LINK.replace('link', 'link or not a directory', 1)}"
    os.mkfifo(root / "real" / "proj" / "pipe")
    err = only(recipe_errors(_recipe(tmp_path, "files_from: real/proj\n")), "files_from")
    assert err["message"].startswith("pipe: a device, FIFO or socket (only regular files)")


def test_paths_inside_the_recipe_directory_still_load(tmp_path: Path) -> None:
    root = tmp_path / "recipe"
    (root / "data" / "proj" / "pkg").mkdir(parents=True)
    (root / "data" / "proj" / "pkg" / "a.py").write_text("A = 1\n")
    (root / "data" / "proj" / "b.txt").write_text("b\n")
    (root / "data" / "rows.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    os.symlink("data/rows.jsonl", root / "rows-link.jsonl")  # a link that stays inside
    recipe = load_recipe(_recipe(tmp_path, "files_from: ./data/proj\ndataset: rows-link.jsonl\n"))
    assert [f.path for f in recipe.run_policy.files] == ["b.txt", "pkg/a.py"]
    assert recipe.row_count() == 2


def test_confined_path_is_one_helper_for_any_field(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    assert confined_path(tmp_path, "a", "verify_files_from") == (tmp_path / "a").resolve()
    with pytest.raises(InvalidRequest) as info:
        confined_path(tmp_path, "/etc", "verify_files_from")
    assert info.value.errors == [
        {"field": "verify_files_from", "message": f"'/etc': must be a path relative to {tmp_path}"}
    ]
    with pytest.raises(InvalidRequest) as info:
        files_under(tmp_path, "..", "verify_files_from")
    assert (info.value.errors or [])[0]["field"] == "verify_files_from"
