"""The ``ephemeral`` command. Each command group lives in its own module; this one wires them."""

from __future__ import annotations

import typer

from ephemeral.cli import (
    admin,
    analysis,
    connections,
    evals,
    export,
    recipes,
    runs,
    sandbox,
    sandboxes,
    serve,
    worker,
)

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Run AI agents on untrusted code in disposable sandboxes, under a hard money cap; "
    "every run is recorded.",
)
runs.register(app)
sandbox.register(app)
admin.register(app)
connections.register(app)
recipes.register(app)
analysis.register(app)
serve.register(app)
evals.register(app)
export.register(app)
sandboxes.register(app)
worker.register(app)


def main() -> None:
    app()
