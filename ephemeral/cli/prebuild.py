"""``ephemeral images prebuild PATH…``: every environment of Harbor tasks, datasets, recipes and
suites made ready before anything runs in them (docs/images.md, "Prebuild")."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ephemeral.cli.exit_codes import ExitCode
from ephemeral.recipes import prebuild
from ephemeral.settings import Settings

STYLES = {"cached": "green", "pulled": "cyan", "built": "blue", "failed": "red"}
SHOWN_ERROR_CHARS = 300


def images_prebuild(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="Harbor task directories, directories of tasks (a dataset), recipes, suites."
        ),
    ],
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            "-j",
            min=1,
            max=prebuild.MAX_WORKERS,
            help="Environments made at once (default: EPHEMERAL_PREBUILD_WORKERS, else the cores).",
        ),
    ] = None,
    retry_failed: Annotated[
        bool,
        typer.Option("--retry-failed", help="Build again what failed before (else its error)."),
    ] = False,
    force_build: Annotated[
        bool,
        typer.Option(
            "--force-build",
            help="Build a task's Dockerfile even when it names a docker_image (as harbor run "
            "--force-build does).",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per environment.")] = (
        False
    ),
) -> None:
    """Resolve every environment the paths name, then pull and build what is missing, in
    parallel; print what each is (cached, pulled, built, failed and why). Exit 1 if any failed."""
    settings = Settings.load()
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:  # a log or a pipe: the table as wide as its rows
        console.width = 160
    found = prebuild.find(settings, paths, force_build=force_build)
    n = prebuild.workers(settings, jobs)
    if as_json:
        outcomes = asyncio.run(
            prebuild.ensure_all(settings, found, jobs=n, retry_failed=retry_failed)
        )
        typer.echo(json.dumps([o.as_json() for o in outcomes], indent=1))
    else:
        outcomes = asyncio.run(_with_progress(settings, found, n, retry_failed, console))
        console.print(_table(outcomes))
        counts = {s: sum(o.status == s for o in outcomes) for s in STYLES}
        console.print(", ".join(f"{v} {k}" for k, v in counts.items()), markup=False)
    if any(o.status == "failed" for o in outcomes):
        raise typer.Exit(ExitCode.FAILED)


async def _with_progress(
    settings: Settings,
    found: list[prebuild.Outcome],
    jobs: int,
    retry_failed: bool,
    console: Console,
) -> list[prebuild.Outcome]:
    columns = (
        TextColumn("[bold]prebuild"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[now]}"),
        TimeElapsedColumn(),
    )
    # a bar on a terminal; elsewhere one line per environment as it is done
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task("prebuild", total=len(found), now="")

        def started(item: prebuild.Outcome) -> None:
            bar.update(task, now=escape(item.env.label[-60:]))

        def done(out: prebuild.Outcome) -> None:
            bar.advance(task)
            if not console.is_terminal:
                console.print(
                    f"{out.status:<7} {out.env.label}  {_why(out)}".rstrip(), markup=False
                )

        return await prebuild.ensure_all(
            settings, found, jobs=jobs, retry_failed=retry_failed, started=started, done=done
        )


def _why(out: prebuild.Outcome) -> str:
    if out.status == "failed":
        return out.detail[:SHOWN_ERROR_CHARS]
    return f"{out.image} ({out.seconds:.1f}s)"


def _table(outcomes: list[prebuild.Outcome]) -> Table:
    table = Table(show_lines=False)
    for col in ("environment", "status", "image / reason", "used by", "seconds"):
        table.add_column(col, overflow="fold")
    for out in outcomes:
        used = out.sources[0] if len(out.sources) == 1 else f"{len(out.sources)} sources"
        style = STYLES[out.status]
        status = out.status + (" (remembered)" if out.remembered else "")
        table.add_row(
            escape(out.env.label),
            f"[{style}]{status}[/{style}]",
            escape(_why(out).rsplit(" (", 1)[0] if out.status != "failed" else _why(out)),
            escape(used),
            f"{out.seconds:.1f}",
        )
    return table


def register(images_app: typer.Typer) -> None:
    images_app.command("prebuild")(images_prebuild)
