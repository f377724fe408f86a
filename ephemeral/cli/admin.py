"""CLI group: admin (``orgs create|credit|show``, ``keys create|revoke|list``).

These talk to the operational store directly (``Settings.db_url``), so they run on the host
that owns the store, not through the HTTP API.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from ephemeral.cli._store import with_store as _with_store
from ephemeral.cli.output import usage
from ephemeral.ids import rfc3339
from ephemeral.money.amounts import parse_usd, usd

if TYPE_CHECKING:
    from ephemeral.store import Org, Store


orgs_app = typer.Typer(no_args_is_help=True, help="Organisations and their balance.")
keys_app = typer.Typer(no_args_is_help=True, help="Member API keys (shown once, stored hashed).")


def _print_org(org: Org) -> None:
    typer.echo(
        f"{org.name} ({org.id})\n"
        f"  balance   {usd(org.balance_micros)} ({org.balance_micros} micros)\n"
        f"  reserved  {usd(org.reserved_micros)} ({org.reserved_micros} micros)\n"
        f"  available {usd(org.available_micros)} ({org.available_micros} micros)"
    )


@orgs_app.command("create")
def orgs_create(name: str = typer.Argument(..., help="Unique org name.")) -> None:
    """Create an organisation with a zero balance."""
    _print_org(_with_store(lambda s: s.orgs.create(name)))


@orgs_app.command("credit")
def orgs_credit(
    name: str = typer.Argument(..., help="Org name or id."),
    dollars: str | None = typer.Option(None, "--usd", help="Amount in dollars, e.g. 10 or 0.25."),
    micros: int | None = typer.Option(None, "--micros", help="Amount in micro-dollars."),
    note: str = typer.Option("", "--note", help="Why (kept in the ledger)."),
) -> None:
    """Add money to an org's balance (negative to correct it)."""
    if (dollars is None) == (micros is None):
        raise usage("give exactly one of --usd or --micros")

    async def go(store: Store) -> Org:
        if micros is not None:
            amount = micros
        else:
            amount = parse_usd(str(dollars), field="--usd", positive=False)
        org = await store.orgs.get(name)
        return await store.orgs.credit(org.id, amount, note or "cli credit")

    _print_org(_with_store(go))


@orgs_app.command("show")
def orgs_show(name: str = typer.Argument(..., help="Org name or id.")) -> None:
    """Show an org's balance, reservations and what is available."""
    _print_org(_with_store(lambda s: s.orgs.get(name)))


@keys_app.command("create")
def keys_create(
    org: str = typer.Option(..., "--org", help="Org name or id."),
    member: str = typer.Option(..., "--member", help="The member's email."),
    as_json: bool = typer.Option(False, "--json", help='Print {"key": ...} only.'),
) -> None:
    """Create a member key. It is printed once and only its hash is stored."""

    async def go(store: Store) -> tuple[str, str]:
        found = await store.orgs.get(org)
        key, plaintext = await store.keys.create(found.id, member)
        return key.id, plaintext

    key_id, plaintext = _with_store(go)
    if as_json:
        typer.echo(json.dumps({"key": plaintext}))
        return
    typer.echo(f"{plaintext}\n(key {key_id} for {member}; shown once, store it now)")


@keys_app.command("revoke")
def keys_revoke(key_id: str = typer.Argument(..., help="The key id (key_...).")) -> None:
    """Revoke a key; requests with it answer 401 from now on."""
    _with_store(lambda s: s.keys.revoke(key_id))
    typer.echo(f"revoked {key_id}")


@keys_app.command("list")
def keys_list(org: str = typer.Option(..., "--org", help="Org name or id.")) -> None:
    """List an org's keys (prefix only; the secret is never stored)."""

    async def go(store: Store) -> list[tuple[str, str, str, str, str]]:
        found = await store.orgs.get(org)
        return [
            (
                k.id,
                k.prefix + "…",
                k.member,
                rfc3339(k.created_at),
                rfc3339(k.revoked_at) if k.revoked_at else "",
            )
            for k in await store.keys.list(found.id)
        ]

    rows = _with_store(go)
    table = Table("id", "prefix", "member", "created", "revoked")
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)


def register(app: typer.Typer) -> None:
    """Add this group's commands to the main app."""
    app.add_typer(orgs_app, name="orgs")
    app.add_typer(keys_app, name="keys")
