"""Recipes and suites: YAML files that declare prompts and a policy, expanded into runs (DESIGN §5).

Loading is all-or-nothing and reports *every* problem at once, each naming the file, the line
and the field (``{"field": "policy.timeout_seconds", "message": …, "file": …, "line": 12}``):
YAML syntax, the schema (unknown keys, wrong types, bad policy values, bad check regexes), the
names the prompt may use, and the prompt itself, which is rendered for every expanded run so
that an undefined variable or a refused attribute is found before anything runs. ``line`` 0
means the file as a whole (unreadable, too large).

The recipe's own cap is ``budget_micros: N``. DESIGN writes it ``budget``; ``budget: N`` and
``budget: {max_cost_micros: N}`` are accepted as the same field. The recipe flow stops starting
runs when the next run's ``max_cost_micros`` would not fit in what is left of it.

Prompts, ``setup`` and ``verify`` are Jinja2 in an immutable, bounded sandbox with
``StrictUndefined`` (:mod:`ephemeral.recipes.templates`); in commands every ``{{ … }}`` is one
shell-quoted word. A template sees ``vars``, the values of its cell and ``repeat_index``
(0-based). ``files_from`` and ``dataset`` are confined to the recipe's directory
(:func:`confined_path`).
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, NamedTuple

from jinja2 import TemplateSyntaxError
from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
)

from ephemeral.errors import InvalidRequest, RecipeError, UnknownModel
from ephemeral.labels import Labels
from ephemeral.models import NO_DEFAULT, NO_MODEL, default_model
from ephemeral.policy import (
    MAX_FILE_BYTES as MAX_RUN_FILE_BYTES,
)
from ephemeral.policy import (
    MAX_FILES,
    MAX_FILES_BYTES,
    MAX_PROMPT_CHARS,
    MAX_STEP_COMMAND_CHARS,
    MAX_STEP_COMMANDS,
    AgentSpec,
    Connection,
    FileSpec,
    ImageName,
    Policy,
)
from ephemeral.recipes import datasets, templates
from ephemeral.recipes.checks import CHECK_KINDS, Check, ShellCheck, ShellCondition, VerifyCondition
from ephemeral.sandbox import hostread
from ephemeral.settings import Settings
from ephemeral.yamlfile import (
    Loc,
    Problem,
    Source,
    check,
    error_of,
    fail,
    fail_errors,
    read_yaml,
    schema_problems,
)

# Planning streams (iter_planned), so this is a sanity bound, not a memory one: the recipe and
# suite budgets are the real caps on what runs.
MAX_PLANNED_RUNS = 1_000_000
NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
MODEL_PATTERN = r"^[a-z0-9][a-z0-9_.-]*/[A-Za-z0-9_.:/-]+$"
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESERVED = frozenset({"repeat_index"})
_NOT_IDENT = "must be an identifier (letters, digits, _) other than repeat_index"
# A key the schema knows under two spellings: errors on one are shown at the line of the other.
_ALIASES = {"budget_micros": "budget", "budget": "budget_micros"}

# --------------------------------------------------------------------------- schema


class _Strict(BaseModel):
    # strict like the policy: `repeat: "3"` is a string, not 3
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _budget_value(v: Any) -> Any:
    if isinstance(v, Mapping):
        if set(v) != {"max_cost_micros"}:
            raise ValueError("must be an integer or {max_cost_micros: N}")
        return v["max_cost_micros"]
    return v


Budget = Annotated[int | None, BeforeValidator(_budget_value)]


def _budget_field() -> Any:
    return Field(default=None, ge=1, validation_alias=AliasChoices("budget_micros", "budget"))


class Recipe(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str = Field(default="", max_length=2_000)
    model: str | None = Field(default=None, pattern=MODEL_PATTERN)
    # an axis: every cell runs on each model (the template variable `model`)
    models: list[Annotated[str, Field(pattern=MODEL_PATTERN)]] = Field(
        default_factory=list, max_length=64
    )
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    vars: dict[str, Any] = Field(default_factory=dict)
    matrix: dict[str, Annotated[list[Any], Field(min_length=1)]] = Field(default_factory=dict)
    repeat: int = Field(default=1, ge=1, le=MAX_PLANNED_RUNS)
    policy: Policy = Field(default_factory=Policy)
    budget_micros: Budget = _budget_field()
    checks: list[Check] = Field(default_factory=list)
    # Cost attribution (ephemeral.labels): on every run of the recipe, beside `recipe`.
    labels: Labels = Field(default_factory=dict)
    # The run's environment (see docs/recipes.md): a built image, commands around the agent
    # (Jinja templates like the prompt) and files put into scratch before setup. The image is a
    # built image's name or an OCI reference.
    image: ImageName | None = None
    setup: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, max_length=MAX_STEP_COMMANDS
    )
    verify: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, max_length=MAX_STEP_COMMANDS
    )
    verify_timeout_seconds: int | None = Field(default=None, ge=1, le=3600)
    files_from: str | None = Field(default=None, min_length=1, max_length=1_000)
    # A program of the recipe's own as the agent, instead of our loop (docs/recipes.md,
    # "Agent runs"); not a template: the prompt reaches it as a file and a variable.
    agent: AgentSpec | None = None
    # a directory (inside the recipe's) put under /tmp/verify after the agent's processes are
    # killed, before verify: files the agent never sees (ephemeral.engine.verify)
    verify_files_from: str | None = Field(default=None, min_length=1, max_length=1_000)
    # Rows of a file as cells (relative to the recipe; .jsonl, .csv or .parquet, read by DuckDB)
    dataset: str | None = Field(default=None, min_length=1, max_length=1_000)
    dataset_filter: str | None = Field(default=None, min_length=1, max_length=2_000)
    dataset_sample: datasets.Sample | None = None
    dataset_limit: int | None = Field(default=None, ge=1)

    _source: Source | None = PrivateAttr(default=None)
    _run_policy: Policy | None = PrivateAttr(default=None)
    _selection: datasets.Selection | None = PrivateAttr(default=None)
    _row_count: int | None = PrivateAttr(default=None)

    @property
    def run_policy(self) -> Policy:
        """``policy`` with the recipe's image, verify slice, files_from files and (unrendered)
        setup/verify: what every run starts from."""
        return self._run_policy if self._run_policy is not None else self.policy

    @property
    def source_file(self) -> str | None:
        return self._source.file if self._source else None

    def cells(self) -> list[dict[str, Any]]:
        """Matrix cells in file order: the first key varies slowest."""
        keys = list(self.matrix)
        return [
            dict(zip(keys, combo, strict=True))
            for combo in itertools.product(*(self.matrix[k] for k in keys))
        ]

    def iter_cells(self) -> Iterator[dict[str, Any]]:
        """Every cell, streamed: dataset rows slowest, then the matrix, then ``models``.

        A cell is the template variables of one run (before ``repeat``): a dataset row's
        columns, the matrix values and, with ``models:``, ``model``."""
        for _, cell in self.iter_numbered_cells():
            yield cell

    def iter_numbered_cells(self) -> Iterator[tuple[int | None, dict[str, Any]]]:
        """:meth:`iter_cells` with each cell's dataset row number (None without a dataset)."""
        matrix = self.cells()
        models: list[str | None] = list(self.models) if self.models else [None]
        for number, row in self._rows():
            for combo in matrix:
                for m in models:
                    cell = {**row, **combo}
                    if m is not None:
                        cell["model"] = m
                    yield number, cell

    def _rows(self) -> Iterator[tuple[int | None, dict[str, Any]]]:
        if self._selection is None:
            yield None, {}
        else:
            yield from datasets.iter_rows(self._selection)

    def row_count(self) -> int:
        if self._selection is None:
            return 1
        if self._row_count is None:
            self._row_count = datasets.count(self._selection)
        return self._row_count

    def run_count(self) -> int:
        cells = math.prod(len(v) for v in self.matrix.values()) * max(1, len(self.models))
        return self.row_count() * cells * self.repeat


class PlannedRun(BaseModel):
    """One run a recipe expands into; nothing has been reserved or started."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recipe: str
    prompt: str
    model: str
    policy: Policy
    cell: dict[str, Any]
    repeat_index: int

    def pair_key(self) -> str:
        """Stable across suite runs: pairs this run with its twin in a previous run."""
        cell = json.dumps(self.cell, sort_keys=True, default=str, separators=(",", ":"))
        return f"{self.recipe}/{cell}/{self.repeat_index}"


class Gates(_Strict):
    min_pass_rate: float = Field(default=1.0, ge=0.0, le=1.0)


class Suite(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str = Field(default="", max_length=2_000)
    recipes: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    budget_micros: Budget = _budget_field()
    gates: Gates = Field(default_factory=Gates)
    concurrency: int = Field(default=2, ge=1, le=64)

    _source: Source | None = PrivateAttr(default=None)
    _loaded: list[Recipe] = PrivateAttr(default_factory=list)

    @property
    def source_file(self) -> str | None:
        return self._source.file if self._source else None

    @property
    def loaded_recipes(self) -> list[Recipe]:
        """The suite's recipes, loaded and validated by :func:`load_suite`, in file order."""
        return list(self._loaded)


# --------------------------------------------------------------------------- YAML with lines


def _read(p: Path, label: str) -> tuple[dict[str, Any], Source, list[Problem]]:
    return read_yaml(p, label, template_key="prompt", aliases=_ALIASES)


# --------------------------------------------------------------------------- pydantic errors


_SCHEMAS: tuple[type[BaseModel], ...] = (
    Recipe,
    Suite,
    Gates,
    Policy,
    FileSpec,
    Connection,
    ShellCondition,
    VerifyCondition,
    *CHECK_KINDS.values(),
)
_KNOWN_FIELDS = sorted({name for model in _SCHEMAS for name in model.model_fields} | {"budget"})


def _check_loc(loc: Loc) -> Loc:
    # A tagged check repeats its key in the location: checks.0.shell.shell.command_matches.
    if len(loc) >= 4 and loc[0] == "checks" and loc[2] in CHECK_KINDS and loc[2] == loc[3]:
        return loc[:2] + loc[3:]
    return loc


def _schema_problems(exc: ValidationError, known: Sequence[str] = _KNOWN_FIELDS) -> list[Problem]:
    return schema_problems(
        exc,
        known,
        relocate=_check_loc,
        not_allowed={("budget",): "budget and budget_micros are the same cap: give one"},
    )


# --------------------------------------------------------------------------- prompts


def _template_lineno(exc: BaseException) -> int | None:
    # Jinja rewrites render tracebacks so frames of the template carry template line numbers.
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _names_problems(recipe: Recipe) -> list[Problem]:
    problems = []
    for key in recipe.vars:
        if not _IDENT.match(key) or key in _RESERVED:
            problems.append(Problem(("vars", key), _NOT_IDENT))
    for key in recipe.matrix:
        if not _IDENT.match(key) or key in _RESERVED:
            problems.append(Problem(("matrix", key), _NOT_IDENT))
        elif key in recipe.vars:
            problems.append(Problem(("matrix", key), "also defined in vars; rename one"))
    if recipe.models:
        if recipe.model is not None:
            problems.append(Problem(("models",), "give model or models, not both"))
        if len(set(recipe.models)) != len(recipe.models):
            problems.append(Problem(("models",), "lists a model twice"))
        for where in ("vars", "matrix"):
            if "model" in getattr(recipe, where):
                problems.append(
                    Problem((where, "model"), "`model` is the models axis's variable; rename it")
                )
    if recipe.run_count() > MAX_PLANNED_RUNS:
        problems.append(
            Problem(
                ("matrix",) if recipe.matrix else ("repeat",),
                f"expands to {recipe.run_count()} runs, more than {MAX_PLANNED_RUNS}",
            )
        )
    if recipe.budget_micros is not None and recipe.budget_micros < recipe.policy.max_cost_micros:
        problems.append(
            Problem(
                ("budget_micros",),
                f"{recipe.budget_micros} is below one run's policy.max_cost_micros "
                f"({recipe.policy.max_cost_micros}): no run could start",
            )
        )
    return problems


class Rendered(NamedTuple):
    cell: dict[str, Any]
    repeat_index: int
    prompt: str
    setup: list[str]
    verify: list[str]


class _RenderProblem(Exception):
    def __init__(self, problem: Problem) -> None:
        self.problem = problem


class _Renderer:
    """The recipe's templates (prompt, setup, verify), compiled once, rendered per cell."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.problems: list[Problem] = []
        self.prompt = self._compile(("prompt",), recipe.prompt)
        self.setup = [self._compile(("setup", i), t) for i, t in enumerate(recipe.setup)]
        self.verify = [self._compile(("verify", i), t) for i, t in enumerate(recipe.verify)]

    def _compile(self, loc: Loc, text: str) -> Any:
        prompt = loc == ("prompt",)
        env = templates.PROMPTS if prompt else templates.COMMANDS
        try:
            template = env.from_string(text)
        except TemplateSyntaxError as exc:
            line = exc.lineno if prompt else None
            self.problems.append(Problem(loc, f"template syntax: {exc.message}", line))
            return None
        if not prompt:
            self.problems += [Problem(loc, why) for why in templates.command_problems(text)]
        return template

    def render(self, cell: dict[str, Any], i: int, row: int | None = None) -> Rendered:
        context = {**self.recipe.vars, **cell, "repeat_index": i}
        if row is not None:
            where = f" (dataset {self.recipe.dataset} row {row})"
        else:
            where = f" (cell {json.dumps(cell, default=str)})" if cell else ""
        text = self._one(("prompt",), self.prompt, context, where)
        if not text.strip():
            raise _RenderProblem(Problem(("prompt",), "renders to an empty prompt" + where))
        if len(text) > MAX_PROMPT_CHARS:
            raise _RenderProblem(
                Problem(("prompt",), f"renders to more than {MAX_PROMPT_CHARS} characters" + where)
            )
        setup = [self._command(("setup", n), t, context, where) for n, t in enumerate(self.setup)]
        verify = [
            self._command(("verify", n), t, context, where) for n, t in enumerate(self.verify)
        ]
        return Rendered(cell, i, text, setup, verify)

    def _one(self, loc: Loc, template: Any, context: dict[str, Any], where: str) -> str:
        try:
            limit = MAX_PROMPT_CHARS if loc == ("prompt",) else MAX_STEP_COMMAND_CHARS
            return templates.render(template, context, limit=limit)
        except Exception as exc:  # noqa: BLE001 - any failure of an author's template is a recipe error
            msg = f"template: {exc or type(exc).__name__}"
            line = _template_lineno(exc) if loc == ("prompt",) else None
            raise _RenderProblem(Problem(loc, msg + where, line)) from None

    def _command(self, loc: Loc, template: Any, context: dict[str, Any], where: str) -> str:
        text = self._one(loc, template, context, where)
        if not text.strip() or "\x00" in text or len(text) > MAX_STEP_COMMAND_CHARS:
            raise _RenderProblem(
                Problem(
                    loc,
                    f"renders to an empty command, a NUL or more than {MAX_STEP_COMMAND_CHARS} "
                    "characters" + where,
                )
            )
        return text


MAX_REPORTED = 20  # distinct render problems listed at most; the rest are counted


def iter_rendered(recipe: Recipe) -> Iterator[Rendered | Problem]:
    """Every cell and repeat, rendered in plan order; a cell that fails yields its problem."""
    renderer = _Renderer(recipe)
    if renderer.problems:
        yield from renderer.problems
        return
    for row, cell in recipe.iter_numbered_cells():
        for i in range(recipe.repeat):
            try:
                yield renderer.render(cell, i, row)
            except _RenderProblem as exc:
                yield exc.problem


def _render_problems(recipe: Recipe) -> list[Problem]:
    """Render every run once without keeping it; each distinct failure is reported once."""
    problems: dict[str, Problem] = {}
    for item in iter_rendered(recipe):
        if isinstance(item, Problem):
            key = item.message.split(" (cell ")[0].split(" (dataset ")[0]
            if key not in problems and len(problems) < MAX_REPORTED:
                problems[key] = item
    return list(problems.values())


def _recipe_problems(recipe: Recipe) -> list[Problem]:
    names = _names_problems(recipe)
    if recipe.run_count() > MAX_PLANNED_RUNS:
        return names  # rendering that many cells is the problem itself
    return names + _render_problems(recipe)


# --------------------------------------------------------------------------- public API


def _relative(base: Path, relative: str, field: str) -> PurePosixPath:
    pure = PurePosixPath(relative)
    if "\x00" in relative or pure.is_absolute():
        raise InvalidRequest.field(field, f"{relative!r}: must be a path relative to {base}")
    if ".." in pure.parts:
        raise InvalidRequest.field(field, f"{relative!r}: must not contain '..'")
    return pure


def confined_path(base: Path, relative: str, field: str) -> Path:
    """``relative`` under the directory ``base``, resolved.

    Recipes name their files relative to their own directory and nothing may leave it: an
    absolute path, a ``..`` part or a symlink that resolves outside ``base`` is an
    :class:`InvalidRequest` naming ``field``. Symlinks that stay inside are followed."""
    pure = _relative(base, relative, field)
    root = base.resolve()
    target = (root / pure).resolve()
    if not target.is_relative_to(root):
        raise InvalidRequest.field(
            field, f"{relative!r} resolves to {target}, outside {root} (through a symlink)"
        )
    return target


def files_under(base: Path, relative: str, field: str) -> list[FileSpec]:
    """The tree at ``relative`` (under the directory ``base``) as run files, within a run's
    limits.

    Read without following a link (ephemeral/sandbox/hostread.py): a link anywhere, the
    directory named, one on the way or a member, even one pointing inside, is an error naming
    ``field``, so nothing outside the tree can be read; only regular files and directories."""
    pure = _relative(base, relative, field)
    root = base.resolve()

    def skip(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        return name == "__pycache__" or name.endswith(".pyc")

    try:
        found = hostread.files(
            root / pure, root=root, skip=skip, max_files=MAX_FILES, max_bytes=MAX_FILES_BYTES
        )
    except FileNotFoundError:
        raise InvalidRequest.field(field, f"no directory {root / pure}") from None
    except hostread.Refused as exc:
        where = f"{exc.rel}: " if exc.rel else ""
        why = f"{where}{exc.why} (nothing is read through a link, in or out of the directory)"
        raise InvalidRequest.field(field, why) from None
    out: list[FileSpec] = []
    for rel, data, _mode in found:
        if rel.endswith("/"):
            continue
        if len(data) > MAX_RUN_FILE_BYTES:
            raise InvalidRequest.field(
                field, f"{rel}: {len(data)} bytes, more than a run's {MAX_RUN_FILE_BYTES} per file"
            )
        out.append(FileSpec(path=rel, content_base64=base64.b64encode(data).decode()))
    if len(out) > MAX_FILES:
        raise InvalidRequest.field(field, f"more than a run's {MAX_FILES} files")
    return sorted(out, key=lambda f: f.path)


def _read_tree(
    recipe: Recipe, base_dir: Path | None, field: str
) -> tuple[list[FileSpec], str | None]:
    """The tree under ``files_from`` or ``verify_files_from`` (relative to the recipe file, and
    confined to its directory: :func:`files_under`) as run files, or why it cannot be read."""
    relative = getattr(recipe, field)
    if relative is None:
        return [], None
    if base_dir is None:
        return [], "needs the recipe's file to be relative to"
    try:
        return files_under(base_dir, relative, field), None
    except InvalidRequest as exc:
        return [], (exc.errors or [{"message": exc.detail}])[0]["message"]


_ENVIRONMENT = ("image", "setup", "verify", "verify_timeout_seconds", "agent")
_DATASET_FIELDS = ("dataset_filter", "dataset_sample", "dataset_limit")


def _dataset_problems(recipe: Recipe, base_dir: Path | None) -> list[Problem]:
    """Resolve the dataset, check its filter, its columns and count its rows (DuckDB)."""
    if recipe.dataset is None:
        return [
            Problem((name,), "needs dataset:")
            for name in _DATASET_FIELDS
            if getattr(recipe, name) is not None
        ]
    if base_dir is None:
        return [Problem(("dataset",), "needs the recipe's file to be relative to")]
    try:
        path = confined_path(base_dir, recipe.dataset, "dataset")
    except InvalidRequest as exc:
        return [Problem(("dataset",), (exc.errors or [{"message": exc.detail}])[0]["message"])]
    selection = datasets.Selection(
        path=path,
        filter=recipe.dataset_filter,
        limit=recipe.dataset_limit,
        sample=recipe.dataset_sample,
    )
    try:
        names = datasets.columns(selection)
        recipe._selection = selection
        recipe._row_count = datasets.count(selection)
    except InvalidRequest as exc:
        first = (exc.errors or [{"field": "dataset", "message": exc.detail}])[0]
        return [Problem((first["field"],), first["message"])]
    taken = (
        set(recipe.vars) | set(recipe.matrix) | _RESERVED | ({"model"} if recipe.models else set())
    )
    problems = [Problem(("dataset",), why) for why in datasets.bad_columns(names, taken)]
    if recipe._row_count == 0:
        problems.append(Problem(("dataset",), f"{selection.path}: no rows selected"))
    return problems


def _environment_problems(recipe: Recipe, base_dir: Path | None) -> list[Problem]:
    """Build the policy every run starts from (image, verify slice, files_from) and check it."""
    problems = [
        Problem(("policy", name), "give it at the top level of the recipe, not in policy")
        for name in _ENVIRONMENT
        if name in recipe.policy.model_fields_set
    ]
    if recipe.agent is not None:
        # Our loop's shell tool writes shell.executed; an agent's commands are its own.
        problems += [
            Problem(
                ("checks", i, "shell"),
                "an agent run has no shell.executed events (its commands are the agent's "
                "own): check verify, the output or the status instead",
            )
            for i, check in enumerate(recipe.checks)
            if isinstance(check, ShellCheck)
        ]
    files, why = _read_tree(recipe, base_dir, "files_from")
    if why is not None:
        problems.append(Problem(("files_from",), why))
    verify_files, why = _read_tree(recipe, base_dir, "verify_files_from")
    if why is not None:
        problems.append(Problem(("verify_files_from",), why))
    if problems:
        return problems
    dumped = recipe.policy.model_dump()
    merged = {
        **dumped,
        "files": [*dumped["files"], *(f.model_dump() for f in files)],
        "verify_files": [*dumped["verify_files"], *(f.model_dump() for f in verify_files)],
        **{name: getattr(recipe, name) for name in _ENVIRONMENT},
    }
    try:
        recipe._run_policy = Policy.model_validate(merged)
    except ValidationError as exc:
        for p in _schema_problems(exc):
            head = p.loc[0] if p.loc else ""
            loc: Loc = (
                ("files_from",)
                if head == "files" and files
                else ("verify_files_from",)
                if head == "verify_files" and verify_files
                else (p.loc if head in _ENVIRONMENT else ("policy", *p.loc))
            )
            problems.append(p._replace(loc=loc))
    return problems


def _build_recipe(
    data: Any, source: Source, dups: list[Problem], base_dir: Path | None = None
) -> Recipe:
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        fail(source, dups + _schema_problems(exc))
    recipe._source = source
    check(source, dups + _environment_problems(recipe, base_dir))
    check(source, _dataset_problems(recipe, base_dir))
    check(source, _recipe_problems(recipe))
    return recipe


def load_recipe(path: str | os.PathLike[str], *, label: str | None = None) -> Recipe:
    """Load, validate and test-render a recipe; raise :class:`RecipeError` listing every problem."""
    p = Path(path)
    data, source, dups = _read(p, label or str(p))
    return _build_recipe(data, source, dups, p.parent)


def load_suite(path: str | os.PathLike[str], *, label: str | None = None) -> Suite:
    """Load a suite and every recipe it names (paths relative to the suite file)."""
    p = Path(path)
    data, source, dups = _read(p, label or str(p))
    return _build_suite(p, data, source, dups)


def _build_suite(p: Path, data: Any, source: Source, dups: list[Problem]) -> Suite:
    try:
        suite = Suite.model_validate(data)
    except ValidationError as exc:
        fail(source, dups + _schema_problems(exc))
    errors = [error_of(source, d) for d in dups]
    loaded: list[Recipe] = []
    names: dict[str, int] = {}
    base_label = os.path.dirname(source.file)
    for i, rel in enumerate(suite.recipes):
        where = Problem(("recipes", i), "")
        target = (p.parent / rel).resolve()
        if not target.is_file():
            errors.append(error_of(source, where._replace(message=f"no recipe file at {target}")))
            continue
        try:
            recipe = load_recipe(target, label=os.path.normpath(os.path.join(base_label, rel)))
        except RecipeError as exc:
            errors.extend(exc.errors or [])
            continue
        if recipe.name in names:
            errors.append(
                error_of(
                    source,
                    where._replace(
                        message=f"recipe name {recipe.name!r} is also recipes[{names[recipe.name]}]"
                    ),
                )
            )
        names[recipe.name] = i
        loaded.append(recipe)
    if suite.budget_micros is not None:
        for i, recipe in enumerate(loaded):
            if suite.budget_micros < recipe.policy.max_cost_micros:
                errors.append(
                    error_of(
                        source,
                        Problem(
                            ("budget_micros",),
                            f"{suite.budget_micros} is below one run of {recipe.name!r} "
                            f"({recipe.policy.max_cost_micros}); recipes[{i}] could never start",
                        ),
                    )
                )
    if errors:
        fail_errors(errors)
    suite._source = source
    suite._loaded = loaded
    return suite


def load_any(path: str | os.PathLike[str]) -> Recipe | Suite:
    """A suite if the file lists ``recipes:`` and has no ``prompt:``, otherwise a recipe."""
    p = Path(path)
    data, source, dups = _read(p, str(p))
    if "recipes" in data and "prompt" not in data:
        return _build_suite(p, data, source, dups)
    return _build_recipe(data, source, dups, p.parent)


def _run_model(recipe: Recipe, default_model: str | None) -> str:
    """The model of the recipe's runs (the models axis aside): its own, the host's default, or
    for an ``agent:`` recipe naming none, :data:`~ephemeral.models.NO_MODEL`."""
    model = recipe.model or default_model
    if model is not None or recipe.models:
        return model or ""
    if recipe.run_policy.agent is not None:
        return NO_MODEL
    source = recipe._source or Source(file=f"<recipe {recipe.name}>")
    fail(source, [Problem(("model",), f"the recipe names no model, and {NO_DEFAULT}")])


def iter_planned(recipe: Recipe, *, default_model: str | None) -> Iterator[PlannedRun]:
    """Every run of the recipe, one at a time, in plan order (see :meth:`Recipe.iter_cells`).

    Streams: nothing but the current run is held, so a 100,000-row dataset plans in constant
    memory. The recipe was test-rendered at load; a row that fails now stops the plan.
    """
    source = recipe._source or Source(file=f"<recipe {recipe.name}>")
    model = _run_model(recipe, default_model)
    base = recipe.run_policy
    templated = bool(recipe.setup or recipe.verify)
    for item in iter_rendered(recipe):
        if isinstance(item, Problem):
            fail(source, [item])
        policy = base
        if templated:
            policy = base.model_copy(update={"setup": item.setup, "verify": item.verify})
        yield PlannedRun(
            recipe=recipe.name,
            prompt=item.prompt,
            model=str(item.cell.get("model", model)) if recipe.models else model,
            policy=policy,
            cell=item.cell,
            repeat_index=item.repeat_index,
        )


def expand(recipe: Recipe, *, default_model: str | None) -> list[PlannedRun]:
    """Every run of the recipe: matrix keys in file order, values in order, then repeats."""
    check(recipe._source or Source(file=f"<recipe {recipe.name}>"), _recipe_problems(recipe))
    return list(iter_planned(recipe, default_model=default_model))


def worst_case_micros(planned: list[PlannedRun]) -> int:
    """What the runs could cost at most: each run's cap, summed."""
    return sum(run.policy.max_cost_micros for run in planned)


def validate_recipe(recipe: Recipe, settings: Settings) -> None:
    """Checks that need the host's configuration: today, that the model has a price.

    Tolerates a build without :mod:`ephemeral.money.pricing`; admission still refuses unknown
    models.
    """
    try:
        from ephemeral.money.pricing import PriceBook
    except ModuleNotFoundError as exc:
        if exc.name == "ephemeral.money.pricing":
            return
        raise
    book = PriceBook.load(settings)
    source = recipe._source or Source(file=f"<recipe {recipe.name}>")
    for i, model in enumerate(recipe.models):
        try:
            book.check_model(model)
        except UnknownModel as exc:
            fail(source, [Problem(("models", i), exc.detail)])
    if recipe.models:
        return
    model = _run_model(recipe, default_model(settings))
    if model == NO_MODEL:
        return
    try:
        book.check_model(model)
    except UnknownModel as exc:
        why = "" if recipe.model else " (the default model: the recipe names none)"
        fail(source, [Problem(("model",), f"{exc.detail}{why}")])


def iter_recipes(item: Recipe | Suite) -> Iterator[Recipe]:
    if isinstance(item, Suite):
        yield from item.loaded_recipes
    else:
        yield item
