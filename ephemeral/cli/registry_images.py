"""CLI commands for registry images, in the ``images`` group: ``images pull|login|logout``
(docs/images.md, "Registry images")."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Annotated

import typer

from ephemeral import errors
from ephemeral.cli.output import fail
from ephemeral.settings import Settings


def images_pull(
    reference: Annotated[str, typer.Argument(help="An OCI reference: ubuntu:24.04, ghcr.io/o/i:t")],
) -> None:
    """Pull an image from its registry into the layer store (layers already here are reused);
    prints its digest."""
    from ephemeral.oci.pull import pull

    settings = Settings.load()
    t0 = time.monotonic()
    try:
        image = asyncio.run(pull(settings, reference, field="REFERENCE"))
    except errors.EphemeralError as exc:
        raise fail(exc) from exc
    size = image.unpacked_bytes / 1e6
    typer.echo(
        f"{image.reference}  {image.digest}  {len(image.layers)} layers  {size:.1f} MB  "
        f"({time.monotonic() - t0:.1f}s)"
    )


def images_login(
    registry: Annotated[str, typer.Argument(help="The registry as references name it: ghcr.io")],
    username: Annotated[str | None, typer.Option("--username", "-u", help="User name.")] = None,
    password_stdin: Annotated[
        bool, typer.Option("--password-stdin", help="Read the password from stdin.")
    ] = False,
    token_stdin: Annotated[
        bool, typer.Option("--token-stdin", help="Read a bearer token from stdin instead.")
    ] = False,
) -> None:
    """Store credentials for a registry, sealed (never on the command line: stdin only)."""
    from ephemeral.oci.credentials import Credential, CredentialStore

    settings = Settings.load()
    try:
        if password_stdin == token_stdin:
            raise errors.InvalidRequest.field(
                "--password-stdin", "give exactly one of --password-stdin or --token-stdin"
            )
        secret = sys.stdin.readline().rstrip("\n")
        if not secret:
            raise errors.InvalidRequest.field("stdin", "no secret on stdin")
        if token_stdin:
            cred = Credential(token=secret)
        else:
            if not username:
                raise errors.InvalidRequest.field("--username", "needed with --password-stdin")
            cred = Credential(username=username, password=secret)
        CredentialStore(settings).set(registry, cred)
    except errors.EphemeralError as exc:
        raise fail(exc) from exc
    typer.echo(f"stored credentials for {registry}")


def images_logout(
    registry: Annotated[str, typer.Argument(help="The registry to forget.")],
) -> None:
    """Remove a registry's stored credentials."""
    from ephemeral.oci.credentials import CredentialStore

    found = CredentialStore(Settings.load()).remove(registry)
    typer.echo(f"removed credentials for {registry}" if found else f"no credentials for {registry}")


def list_pulled(settings: Settings) -> None:
    """The references pulled here (``images list`` prints them after the built images)."""
    from ephemeral.oci.store import LayerStore

    store = LayerStore(settings)
    for ref, digest in sorted(store.references().items()):
        image = store.image(digest)
        size = f"{image.unpacked_bytes / 1e6:7.1f} MB" if image is not None else "    ? MB"
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(image.pulled_at)) if image else ""
        typer.echo(f"  {ref}  {digest[:19]}  {size}  {when}  (pulled)")


def remove_pulled(settings: Settings, name: str) -> None:
    """``images rm REF``: forget a pulled reference; ``images gc`` then frees what only it
    used."""
    from ephemeral.oci.reference import parse
    from ephemeral.oci.store import LayerStore

    try:
        ref = parse(name, field="NAME")
    except errors.EphemeralError as exc:
        raise fail(exc) from exc
    found = LayerStore(settings).remove_ref(ref)
    typer.echo(f"removed {ref}" if found else f"{ref} was not pulled here")


def register(images_app: typer.Typer) -> None:
    images_app.command("pull")(images_pull)
    images_app.command("login")(images_login)
    images_app.command("logout")(images_logout)
