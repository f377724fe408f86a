"""CLI group: analysis of recorded runs (``query``, ``costs``, ``records``, ``report``)."""

from __future__ import annotations

import asyncio
import csv
import enum
import json
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from ephemeral.cli.output import fail
from ephemeral.errors import EphemeralError
from ephemeral.records import COST_COLUMNS, COST_DIMENSIONS, Records, cost_dimensions, parse_since
from ephemeral.records.report import render_costs_html, usd
from ephemeral.settings import Settings


class Format(enum.StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


def _remote_costs(
    settings: Settings, by: str, since: str
) -> tuple[list[str], list[tuple[Any, ...]]]:
    from ephemeral.client import Client

    with Client(settings) as client:
        page = client.costs(by=by, since=since)
    dims = cost_dimensions(by)
    columns = [*(["key"] if len(dims) == 1 else [d[0] for d in dims]), *COST_COLUMNS[1:]]
    return columns, [tuple(row[c] for c in columns) for row in page["rows"]]


def _records() -> Records:
    return Records(Settings.load().records_dir)


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def _table(*headers: str) -> Table:
    table = Table()
    for header in headers:
        # Never an ellipsis: a cut-off amount of money reads as a different amount.
        table.add_column(header, overflow="fold")
    return table


def _print(table: Table) -> None:
    # Piped output gets room for the whole table; a terminal folds long cells instead.
    width = None if sys.stdout.isatty() else 1000
    Console(width=width).print(table)


def _emit(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: Format) -> None:
    if fmt is Format.json:
        items = [dict(zip(columns, row, strict=True)) for row in rows]
        typer.echo(json.dumps(items, default=str, indent=2))
    elif fmt is Format.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([[_cell(v) for v in row] for row in rows])
    else:
        table = _table(*columns)
        for row in rows:
            table.add_row(*(_cell(v) for v in row))
        _print(table)


def _cost_rows(
    columns: list[str], rows: list[tuple[Any, ...]]
) -> tuple[list[str], list[list[Any]]]:
    """Add ``*_usd`` next to every ``*_micros`` column (machine formats keep the raw micros)."""
    out_cols: list[str] = []
    for col in columns:
        out_cols.append(col)
        if col.endswith("_micros"):
            out_cols.append(col.removesuffix("_micros") + "_usd")
    out_rows = []
    for row in rows:
        out: list[Any] = []
        for col, value in zip(columns, row, strict=True):
            out.append(value)
            if col.endswith("_micros"):
                out.append(usd(value))
        out_rows.append(out)
    return out_cols, out_rows


def _cost_table(by: str, columns: list[str], rows: list[tuple[Any, ...]]) -> None:
    dims = columns[: columns.index("runs")]
    heads = [by] if dims == ["key"] else dims
    table = _table(*heads, "runs", "charged", "model", "web", "compute", "tokens in", "tokens out")
    totals = [0] * (len(columns) - len(dims))
    for row in rows:
        values = dict(zip(columns, row, strict=True))
        totals = [t + int(v or 0) for t, v in zip(totals, row[len(dims) :], strict=True)]
        table.add_row(
            *(_cell(values[d]) for d in dims),
            str(values["runs"]),
            usd(values["charged_micros"]),
            usd(values["model_micros"]),
            usd(values["web_micros"]),
            usd(values["compute_micros"]),
            str(values["input_tokens"]),
            str(values["output_tokens"]),
        )
    if not rows:
        table.caption = "no recorded runs in this window"
    else:
        t = dict(zip(columns[len(dims) :], totals, strict=True))
        table.add_section()
        table.add_row(
            "total",
            *([""] * (len(dims) - 1)),
            str(t["runs"]),
            usd(t["charged_micros"]),
            usd(t["model_micros"]),
            usd(t["web_micros"]),
            usd(t["compute_micros"]),
            str(t["input_tokens"]),
            str(t["output_tokens"]),
        )
    _print(table)


def query(
    sql: str = typer.Argument(..., help="SQL over the views runs, steps and events."),
    fmt: Format = typer.Option(Format.table, "--format", help="table, csv or json."),
) -> None:
    """Run one read-only SQL statement (DuckDB) over the views runs, steps and events."""
    try:
        columns, rows = _records().query(sql)
    except EphemeralError as err:
        raise fail(err) from err
    _emit(columns, rows, fmt)


def costs(
    by_options: list[str] = typer.Option(
        ...,
        "--by",
        help=f"One or more of: {', '.join(COST_DIMENSIONS)}, label:KEY; separated by commas "
        "or repeated (--by model --by recipe groups by both).",
    ),
    since: str = typer.Option("30d", "--since", help="Window like 30d, 12h, 2w, or 'all'."),
    fmt: Format = typer.Option(Format.table, "--format", help="table, csv or json."),
) -> None:
    """Spend grouped by model, recipe, day, org, status, kind or a label, or several of them
    (USD; csv/json add raw micros).

    With EPHEMERAL_URL set, asks that server for your org's spend instead of local records.
    """
    by = ",".join(by_options)
    settings = Settings.load()
    try:
        if settings.url:
            columns, rows = _remote_costs(settings, by, since)
        else:
            columns, rows = Records(settings.records_dir).costs(by, parse_since(since))
    except EphemeralError as err:
        raise fail(err) from err
    if fmt is Format.table:
        _cost_table(by, columns, rows)
    else:
        _emit(*_cost_rows(columns, rows), fmt)


records_app = typer.Typer(no_args_is_help=True, help="Maintain the recorded runs.")
report_app = typer.Typer(no_args_is_help=True, help="Reports over the recorded runs.")


@records_app.command("compact")
def records_compact(
    older_than_days: int = typer.Option(
        1, "--older-than-days", min=0, help="Compact partitions dated at least N days ago."
    ),
) -> None:
    """Merge per-run files of old partitions into one compacted file each."""
    try:
        merged = _records().compact(older_than_days)
    except EphemeralError as err:
        raise fail(err) from err
    typer.echo(f"compacted {merged} files")


@records_app.command("purge")
def records_purge(
    retention_days: int | None = typer.Option(
        None,
        "--retention-days",
        min=0,
        help="Purge content older than N days (default: EPHEMERAL_RETENTION_DAYS, 30).",
    ),
) -> None:
    """Remove content (prompts, commands, outputs) past retention; billing stays.

    Applies to the Parquet records and to the operational store alike.
    """
    settings = Settings.load()
    days = settings.retention_days if retention_days is None else retention_days
    try:
        purged = Records(settings.records_dir).purge_content(days)
        erased = asyncio.run(_erase_expired(settings, days))
        from ephemeral.evals.store import purge_reports

        reports = purge_reports(settings, days)
    except EphemeralError as err:
        raise fail(err) from err
    typer.echo(
        f"purged content of {purged} records and {erased} stored runs older than {days} days"
        f"; removed {reports} eval summary files"
    )


async def _erase_expired(settings: Settings, days: int) -> int:
    from ephemeral.store import Store

    store = await Store.open(settings.db_url)
    try:
        expired = await store.retention.expired(timedelta(days=days))
        for run_id in expired:
            await store.retention.erase(run_id)
        return len(expired)
    finally:
        await store.close()


@report_app.command("costs")
def report_costs(
    html: Path = typer.Option(..., "--html", help="Write the report to this HTML file."),
    since: str = typer.Option("30d", "--since", help="Window like 30d, 12h, 2w, or 'all'."),
    by_options: list[str] = typer.Option(
        [],
        "--by",
        help="Also a table grouped by these dimensions, as for `costs --by` "
        "(model,recipe,label:team).",
    ),
) -> None:
    """Write a self-contained HTML cost report (totals, breakdown, per-day chart)."""
    try:
        page = render_costs_html(_records(), parse_since(since), by=",".join(by_options) or None)
    except EphemeralError as err:
        raise fail(err) from err
    html.write_text(page, encoding="utf-8")
    typer.echo(f"wrote {html}")


def register(app: typer.Typer) -> None:
    """Add this group's commands to the main app."""
    app.command("query")(query)
    app.command("costs")(costs)
    app.add_typer(records_app, name="records")
    app.add_typer(report_app, name="report")
