"""The ``ephemeral`` command: :func:`main`; its Typer app, ``app``, is built on first use.

Importing every command group takes ~0.9 s of CPU (seconds on a loaded host), so ``run`` and
``eval`` say they are starting before that: a piped run's first line comes within a second
(docs/deploy.md, "How long a start takes").
"""

from __future__ import annotations

import sys
from typing import Any

STARTING = "ephemeral: starting"
_ANNOUNCED = ("run", "eval")


def __getattr__(name: str) -> Any:
    if name == "app":
        from ephemeral.cli.commands import app

        return app
    raise AttributeError(name)


def main() -> None:
    args = sys.argv[1:]
    if args[:1] and args[0] in _ANNOUNCED and not {"--help", "-h"} & set(args):
        sys.stderr.write(STARTING + "\n")
        sys.stderr.flush()
    from ephemeral.cli.commands import main as run_command

    run_command()
