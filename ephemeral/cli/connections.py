"""CLI group: ``connections add|list|rm``, the broker's per-org credentials (docs/broker.md).

Secrets go in once, with ``add``, and are sealed before they reach the store; ``list`` shows
header names only. These commands talk to the operational store directly (``Settings.db_url``),
so they run on the host that owns the store and its broker key file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from ephemeral import errors
from ephemeral.cli._store import with_store
from ephemeral.cli.output import fail
from ephemeral.ids import rfc3339
from ephemeral.settings import Settings

if TYPE_CHECKING:
    from ephemeral.store import Store
    from ephemeral.store.connections import StoredConnection

T = TypeVar("T")
LOCAL_ORG = (
    "local"  # the org the embedded `ephemeral run` uses (ephemeral.engine.runtime.LOCAL_ORG)
)

app = typer.Typer(no_args_is_help=True, help="Broker connections: an API's base URL + credentials.")
ORG_OPTION = typer.Option(LOCAL_ORG, "--org", help="Org name or id.")


def _with_store(settings: Settings, fn: Callable[[Store], Awaitable[T]]) -> T:
    return with_store(fn, settings)


async def _org_id(store: Store, org: str) -> str:
    if org == LOCAL_ORG:
        from ephemeral.engine.runtime import LOCAL_ORG_CREDIT_MICROS

        made = await store.orgs.ensure(LOCAL_ORG, initial_credit_micros=LOCAL_ORG_CREDIT_MICROS)
        return made.id
    return (await store.orgs.get(org)).id


def _env_header(spec: str) -> tuple[str, str]:
    """``NAME=VAR`` (header NAME, value from $VAR) or ``VAR`` ($VAR holds 'Name: value')."""
    from ephemeral.broker.connections import parse_header

    name, sep, var = spec.partition("=")
    var = var if sep else name
    # A secret read from the environment at add time, so it never sits in shell history.
    value = os.environ.get(var)
    if value is None:
        raise errors.InvalidRequest.field("--header-env", f"environment variable {var} is not set")
    if sep:
        return parse_header(f"{name}: {value}", "--header-env")
    return parse_header(value, "--header-env")


@app.command("add")
def add(
    name: str = typer.Argument(..., help="Connection name, as a policy's connections[].name."),
    base_url: str = typer.Option(..., "--base-url", help="e.g. https://api.example.com/v1"),
    header: list[str] = typer.Option(
        [], "--header", help="'Name: value' credential header (repeatable)."
    ),
    header_env: list[str] = typer.Option(
        [], "--header-env", help="NAME=VAR: header NAME from env var VAR (or VAR='Name: value')."
    ),
    org: str = ORG_OPTION,
    replace: bool = typer.Option(False, "--replace", help="Overwrite an existing connection."),
) -> None:
    """Add a connection. Its headers are sealed in the store and never shown again."""
    from ephemeral.broker.connections import check_base_url, parse_header
    from ephemeral.broker.secrets import Sealer
    from ephemeral.store.connections import check_name

    settings = Settings.load()
    try:
        check_name(name)
        url = check_base_url(base_url)
        headers: dict[str, str] = {}
        for h in [parse_header(h) for h in header] + [_env_header(e) for e in header_env]:
            if h[0].lower() in (k.lower() for k in headers):
                raise errors.InvalidRequest.field("--header", f"{h[0]} given twice")
            headers[h[0]] = h[1]
    except errors.EphemeralError as exc:
        raise fail(exc) from exc
    sealed = Sealer.for_settings(settings).seal(headers)

    async def go(store: Store) -> StoredConnection:
        return await store.connections.add(
            await _org_id(store, org),
            name,
            base_url=url,
            header_names=list(headers),
            sealed_headers=sealed,
            replace=replace,
        )

    made = _with_store(settings, go)
    shown = ", ".join(made.header_names) or "no headers"
    typer.echo(f"added connection {made.name} → {made.base_url} ({shown})")


@app.command("list")
def list_(
    org: str = ORG_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list."),
) -> None:
    """List an org's connections: names, base URLs and header names, never their values."""
    settings = Settings.load()

    async def go(store: Store) -> list[StoredConnection]:
        return await store.connections.list(await _org_id(store, org))

    found = _with_store(settings, go)
    if as_json:
        rows = [
            {
                "name": c.name,
                "base_url": c.base_url,
                "headers": c.header_names,
                "created_at": rfc3339(c.created_at),
            }
            for c in found
        ]
        typer.echo(json.dumps(rows))
        return
    table = Table("name", "base url", "headers", "created")
    for c in found:
        table.add_row(c.name, c.base_url, ", ".join(c.header_names), rfc3339(c.created_at))
    Console(width=160).print(table)


@app.command("rm")
def rm(name: str = typer.Argument(..., help="Connection name."), org: str = ORG_OPTION) -> None:
    """Remove a connection; runs that name it are refused at admission from now on."""
    settings = Settings.load()

    async def go(store: Store) -> None:
        await store.connections.remove(await _org_id(store, org), name)

    _with_store(settings, go)
    typer.echo(f"removed connection {name}")


def register(root: typer.Typer) -> None:
    """Add this group's commands to the main app."""
    root.add_typer(app, name="connections")
