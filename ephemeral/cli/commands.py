"""The ``ephemeral`` command's groups, wired (each group lives in its own module)."""

from __future__ import annotations

import signal
from types import FrameType

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
serve.register_view(app)
evals.register(app)
export.register(app)
sandboxes.register(app)
worker.register(app)


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> None:
    # SIGTERM (what a service manager or container runtime sends) unwinds like Ctrl-C: runs are
    # cancelled, their sandboxes destroyed and Prefect's embedded server stopped. Python's
    # default ends the process at once and leaves them. `serve` and `worker` install their own.
    signal.signal(signal.SIGTERM, _terminated)
    app()
