"""CLI group: recipes. Check and preview recipes and suites without running anything."""

from __future__ import annotations

import contextlib
import json
import textwrap
from pathlib import Path

import typer

from ephemeral.cli.exit_codes import ExitCode
from ephemeral.cli.output import fail, report
from ephemeral.errors import EphemeralError
from ephemeral.models import default_model
from ephemeral.money.amounts import usd
from ephemeral.policy import Policy
from ephemeral.recipes.recipe import (
    PlannedRun,
    Recipe,
    Suite,
    expand,
    iter_recipes,
    load_any,
    validate_recipe,
    worst_case_micros,
)
from ephemeral.settings import Settings

PROMPT_PREVIEW_LINES = 12
PROMPT_PREVIEW_CHARS = 800
PROMPT_WIDTH = 92


def _load(path: Path, settings: Settings) -> Recipe | Suite:
    if not path.exists() and path.name == str(path):  # a shipped recipe or suite, by name
        from ephemeral.evals.plan import resolve_path

        with contextlib.suppress(EphemeralError):  # not one: the file's own error follows
            path = resolve_path(str(path), settings)
    item = load_any(path)
    for recipe in iter_recipes(item):
        validate_recipe(recipe, settings)
    return item


def _policy_summary(p: Policy) -> str:
    parts = [
        f"shell {'on' if p.shell else 'off'}",
        f"web {'on' if p.web else 'off'}",
        f"files {', '.join(f.path for f in p.files) or 'none'}",
        f"connections {', '.join(c.name for c in p.connections) or 'none'}",
        f"zdr {'on' if p.zero_data_retention else 'off'}",
        f"timeout {p.timeout_seconds} s",
        f"cap {usd(p.max_cost_micros)}",
        f"isolation {p.isolation}",
    ]
    if p.image is not None:
        parts.append(f"image {p.image}")
    if p.setup:
        parts.append(f"setup {len(p.setup)} command(s)")
    if p.verify:
        parts.append(f"verify {len(p.verify)} command(s) in {p.verify_reserve_seconds()} s")
    if p.agent is not None:
        answer = f", answer in {p.agent.output}" if p.agent.output else ", answer on stdout"
        parts.append(f"agent (own program) in image {p.run_image or 'default'}{answer}")
    return " · ".join(parts)


def _preview(prompt: str) -> str:
    """The prompt wrapped for reading, cut at a few lines; the JSON output has it whole."""
    lines = [
        wrapped
        for line in prompt[:PROMPT_PREVIEW_CHARS].splitlines()
        for wrapped in (textwrap.wrap(line, PROMPT_WIDTH, drop_whitespace=False) or [""])
    ]
    shown = lines[:PROMPT_PREVIEW_LINES]
    if len(shown) < len(lines) or len(prompt) > PROMPT_PREVIEW_CHARS:
        shown.append(f"… ({len(prompt)} chars in all; --json prints it whole)")
    return "\n".join(f"    │ {line}" for line in shown)


def _show_recipe(recipe: Recipe, runs: list[PlannedRun]) -> None:
    typer.echo(f"{recipe.source_file}: {recipe.name}: {len(runs)} run(s)")
    for n, run in enumerate(runs, 1):
        cell = json.dumps(run.cell, default=str) if run.cell else "-"
        typer.echo(f"  #{n} cell {cell} · repeat {run.repeat_index} · model {run.model}")
        typer.echo(f"    {_policy_summary(run.policy)}")
        typer.echo(_preview(run.prompt))
    budget = usd(recipe.budget_micros) if recipe.budget_micros is not None else "none"
    typer.echo(f"  worst case {usd(worst_case_micros(runs))} · recipe budget {budget}")


def register(app: typer.Typer) -> None:
    """Add this group's commands to the main app."""
    group = typer.Typer(
        no_args_is_help=True,
        help="Check and preview recipes and suites without running anything.",
    )
    app.add_typer(group, name="recipes")

    @group.command("validate")
    def validate(
        files: list[Path] = typer.Argument(
            ..., help="Recipe or suite files, or shipped ones by name."
        ),
    ) -> None:
        """Report every problem as file:line: field: message; exit 1 if there is any."""
        settings = Settings.load()
        failed = False
        for path in files:
            try:
                item = _load(path, settings)
            except EphemeralError as exc:  # a recipe's problems, or the host's price book
                report(exc, prefix=f"{path}: ")
                failed = True
                continue
            kind = (
                f"suite of {len(item.loaded_recipes)} recipes"
                if isinstance(item, Suite)
                else "recipe"
            )
            typer.echo(f"{path}: ok ({kind})")
        raise typer.Exit(ExitCode.FAILED if failed else ExitCode.OK)

    @group.command("show")
    def show(
        file: Path = typer.Argument(..., help="A recipe or suite file, or a shipped one by name."),
        as_json: bool = typer.Option(False, "--json", help="Print the planned runs as JSON."),
    ) -> None:
        """Print the runs a recipe (or each recipe of a suite) expands into, and the worst case."""
        settings = Settings.load()
        try:
            item = _load(file, settings)
            plans = [
                (r, expand(r, default_model=default_model(settings))) for r in iter_recipes(item)
            ]
        except EphemeralError as exc:
            raise fail(exc, prefix=f"{file}: ") from None
        if as_json:
            every = [run.model_dump(mode="json") for _, runs in plans for run in runs]
            typer.echo(json.dumps(every, indent=2, ensure_ascii=False))
            return
        for recipe, runs in plans:
            _show_recipe(recipe, runs)
        if isinstance(item, Suite):
            total = sum(worst_case_micros(runs) for _, runs in plans)
            budget = usd(item.budget_micros) if item.budget_micros is not None else "none"
            typer.echo(f"suite {item.name}: worst case {usd(total)} · suite budget {budget}")
