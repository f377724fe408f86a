"""CLI group: ``eval`` — run an eval suite (or a recipe) here, live, and gate on its pass rate.

Exit status (ephemeral/cli/exit_codes.py): 0 every gate passed, 1 a gate failed (e.g.
``min_pass_rate``), 2 bad input, 3 the suite could not run.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ephemeral import errors, progress
from ephemeral.cli.exit_codes import ExitCode
from ephemeral.cli.output import fail
from ephemeral.cli.progress import announcing, quiet, start_prefect
from ephemeral.money.amounts import usd
from ephemeral.settings import Settings

if TYPE_CHECKING:
    from ephemeral.evals.plan import Evaluation
    from ephemeral.evals.report import Report
    from ephemeral.evals.result import RunResult
    from ephemeral.evals.suite import Progress as SuiteProgress


async def _run(
    settings: Settings,
    evaluation: Evaluation,
    source: Path,
    console: Console,
    knobs: dict[str, Any],
) -> Report:
    from ephemeral.engine.runtime import Runtime
    from ephemeral.evals.plan import planned_count, resolve_path
    from ephemeral.evals.report import Report
    from ephemeral.evals.store import write_report
    from ephemeral.evals.suite import run_evaluation, watch
    from ephemeral.flows.executor import executor_for
    from ephemeral.recipes.recipe import validate_recipe

    for recipe in evaluation.recipes:  # a bad recipe fails here, before any run
        validate_recipe(recipe, settings)
    total = planned_count(evaluation, settings)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task(evaluation.name, total=total, status="starting")
        if console.is_terminal:  # the bar holds the terminal: the stage is its status
            quiet()
            progress.listen(lambda stage: bar.update(task, status=stage))

        def observe(p: SuiteProgress) -> None:
            status = f"passing {p.passing} · spent {usd(p.spent_micros)}"
            bar.update(task, completed=p.done, status=status)
            if p.last is not None:
                bar.console.print(_line(p, p.last), markup=False, highlight=False)

        runtime = await Runtime.start(settings, executor=executor_for(settings))
        try:
            with watch(evaluation.suite_run_id, observe):
                if settings.executor != "plain":
                    from ephemeral.flows.eval_suite import eval_suite_flow

                    await eval_suite_flow(runtime)(
                        suite=str(resolve_path(str(source), settings).resolve()),
                        compare=evaluation.compare_with,
                        suite_run_id=evaluation.suite_run_id,
                        knobs=knobs,
                    )
                    saved = settings.state_dir / "evals" / f"{evaluation.suite_run_id}.json"
                    return Report.model_validate_json(saved.read_text())
                report = await run_evaluation(runtime, evaluation)
                write_report(report, settings)
                return report
        finally:
            await runtime.close()


def _line(p: SuiteProgress, r: RunResult) -> str:

    where = f"[{p.done}/{p.total}] {r.pair_key}"
    if r.run_id is None:
        return f"{where}  {r.status}: {r.detail}"
    ok = sum(1 for c in r.checks if c.passed)
    verdict = r.outcome.upper()
    took = f"{(r.duration_ms or 0) / 1000:.1f} s"
    return (
        f"{where}  {verdict}  {r.run_id} {r.status} · checks {ok}/{len(r.checks)} · "
        f"{usd(r.charged_micros)} · {took}"
    )


def _print_report(report: Report, console: Console) -> None:
    from ephemeral.evals.render import render_comparison, table_rows

    table = Table(title=f"{report.suite} · suite run {report.suite_run_id}")
    for header, justify in (
        ("recipe", "left"),
        ("check", "left"),
        ("passed", "right"),
        ("rate", "right"),
        ("error", "right"),
        ("cancelled", "right"),
        ("budget", "right"),
        ("charged", "right"),
        ("run time", "right"),
    ):
        table.add_column(header, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for row in table_rows(report):
        whole = row["check"] == "(all checks)"
        style = "bold" if whole else None
        rate = row["pass_rate"]
        colour = "green" if rate >= 1 else "red" if rate < report.min_pass_rate else "yellow"
        table.add_row(
            row["recipe"] if whole else "",
            row["check"],
            f"{row['passed']}/{row['runs']}",
            f"[{colour}]{rate:.0%}[/{colour}]",
            *("" if row[k] is None else str(row[k]) for k in ("error", "cancelled", "budget")),
            usd(row["charged_micros"]) if row["charged_micros"] is not None else "",
            f"{row['duration_ms'] / 1000:.1f} s" if row["duration_ms"] is not None else "",
            style=style,
        )
    console.print(table)
    for r in report.results:
        if not r.graded:
            console.print(
                f"[yellow]{r.outcome.upper()}[/yellow] "
                + escape(f"{r.run_id or '(not run)'} {r.pair_key} · {r.status}: {r.detail}"),
                highlight=False,
            )
            continue
        for c in r.checks:
            if not c.passed:
                console.print(
                    f"[red]FAIL[/red] {r.run_id} {r.pair_key} · {c.check}: {c.reason}",
                    highlight=False,
                )
    counts = " · ".join(f"{n} {o}" for o, n in report.outcomes.items())
    console.print(
        f"{len(report.results)} runs: {counts} · "
        f"charged {usd(report.charged_micros)} · {report.wall_ms / 1000:.1f} s",
        highlight=False,
    )
    for line in render_comparison(report.comparison):
        if line and not line.startswith("#"):
            console.print(line, markup=False, highlight=False)
        elif line:
            console.print(f"[bold]{line.lstrip('# ')}[/bold]", highlight=False)
    for failure in report.gate_failures:
        console.print(f"[red]gate failed:[/red] {failure}", highlight=False)

    verdict = "[green]PASSED[/green]" if report.passed else "[red]FAILED[/red]"
    console.print(
        f"{verdict} · compare a later run with: ephemeral eval SUITE "
        f"--compare {report.suite_run_id}",
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_(
        suite: Annotated[Path, typer.Argument(help="A suite (or recipe) YAML file.")],
        compare: Annotated[
            str | None,
            typer.Option("--compare", help="A previous suite run id to compare with."),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
        no_prefect: Annotated[
            bool, typer.Option("--no-prefect", help="Run without Prefect.")
        ] = False,
        limit: Annotated[
            int | None, typer.Option("--limit", min=1, help="Run only the first N planned runs.")
        ] = None,
        filter_: Annotated[
            list[str] | None,
            typer.Option(
                "--filter",
                help="Only the runs whose cell has KEY=VALUE (a matrix or dataset column, "
                "recipe=NAME or model=M); repeat to require several.",
            ),
        ] = None,
        model: Annotated[
            str | None,
            typer.Option("--model", help="Run every recipe on this model (replaces models:)."),
        ] = None,
        concurrency: Annotated[
            int | None,
            typer.Option(
                "--concurrency", min=1, max=64, help="Runs at once (the suite's, else 2)."
            ),
        ] = None,
        repeat: Annotated[
            int | None,
            typer.Option(
                "--repeat",
                min=1,
                max=100,
                help="Epochs: runs per cell (replaces repeat:); the table adds pass@K per recipe.",
            ),
        ] = None,
    ) -> None:
        """Run an eval suite locally with live progress; print the pass table.

        Exit status: 0 every gate passed, 1 a gate failed, 2 bad input, 3 error.

        While it starts, what it waits for (loading Prefect, its server, the store, an image)
        is the progress bar's status on a terminal, one "ephemeral: <stage>" line on stderr
        otherwise.
        """
        from ephemeral.evals.plan import evaluation_for, parse_filter
        from ephemeral.evals.report import report_json

        settings = Settings.load(**({"executor": "plain"} if no_prefect else {}))
        console = Console(stderr=as_json, highlight=False, soft_wrap=True)
        if not console.is_terminal:
            console = Console(stderr=as_json, highlight=False, soft_wrap=True, width=160)
        try:
            if settings.url:
                raise errors.InvalidRequest.field(
                    "EPHEMERAL_URL", "eval runs suites on this host; unset it to run one here"
                )
            filters = [parse_filter(f) for f in filter_ or []]
            if model is not None:
                _require_model(model, settings)
            knobs: dict[str, Any] = {
                k: v
                for k, v in {
                    "limit": limit,
                    "filters": filters,
                    "model": model,
                    "repeat": repeat,
                    "concurrency": concurrency,
                }.items()
                if v
            }
            evaluation = evaluation_for(str(suite), settings, compare_with=compare, **knobs)
            with announcing():  # on a terminal the progress bar shows the stages (_run)
                start_prefect(settings)
                report = asyncio.run(_run(settings, evaluation, suite, console, knobs))
        except errors.EphemeralError as exc:
            raise fail(exc) from exc
        if as_json:
            sys.stdout.write(json.dumps(report_json(report), indent=2) + "\n")
        else:
            _print_report(report, console)
        # where it is, on stderr so that --json stays clean: the id for `export`, the report
        report_path = settings.state_dir / "evals" / f"{report.suite_run_id}.json"
        where = Console(stderr=True, highlight=False, soft_wrap=True)
        where.print(f"suite run: {report.suite_run_id}", markup=False)
        where.print(f"report: {report_path} (and .md)", markup=False)
        where.print(
            f"page: /suites/{report.suite_run_id} (ephemeral view, or ephemeral serve)",
            markup=False,
        )
        raise typer.Exit(ExitCode.OK if report.passed else ExitCode.FAILED)


def _require_model(model: str, settings: Settings) -> None:
    """``--model`` must be a model this host can serve and price, refused naming the flag."""
    from ephemeral.money.pricing import PriceBook
    from ephemeral.providers.registry import provider_for

    try:
        provider_for(model, settings)
        PriceBook.load(settings).check_model(model)
    except errors.UnknownModel as exc:
        message = exc.errors[0]["message"] if exc.errors else exc.detail
        raise errors.InvalidRequest.field("--model", message) from exc
