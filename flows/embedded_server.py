"""Prefect's embedded server, made to end with the process that started it.

Prefect stops its embedded server only from an ``atexit`` hook, which SIGKILL and Python's
default SIGTERM never run (docs/deploy.md, "Stopping serve, run and eval"). Entry points call
:func:`configure` instead of :func:`ephemeral.prefect_setup.configure`: with no
``PREFECT_API_URL``, Prefect's server module then starts
``python -m ephemeral.flows.embedded_prefect`` (its uvicorn arguments, unchanged), which stops
itself once its parent is gone.
"""

from __future__ import annotations

import os
import subprocess
import types
from typing import Any

from ephemeral import prefect_setup
from ephemeral.flows import prefect_private
from ephemeral.flows.embedded_prefect import PARENT_ENV
from ephemeral.settings import Settings


def configure(settings: Settings) -> None:
    """:func:`ephemeral.prefect_setup.configure`, then :func:`guard_embedded_server` when
    Prefect will start its own server (imported after its environment is set), then the check
    that the installed Prefect has every private part this process touches
    (:func:`ephemeral.flows.prefect_private.check`: fails naming the part)."""
    prefect_setup.configure(settings)
    embedded = prefect_setup.embedded()
    if embedded:
        guard_embedded_server()
    prefect_private.check(embedded=embedded)


def _guarded_popen(args: Any, *rest: Any, **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen`` for Prefect's server module: its ``python -m uvicorn`` becomes
    ``python -m ephemeral.flows.embedded_prefect`` (same arguments), which ends with this
    process."""
    argv = list(args)
    if argv[1:3] == ["-m", "uvicorn"]:
        argv[1:3] = ["-m", "ephemeral.flows.embedded_prefect"]
        env = kwargs.get("env")
        kwargs["env"] = {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}
    return subprocess.Popen(argv, *rest, **kwargs)


def guard_embedded_server() -> None:
    """Make the embedded Prefect server die with this process (flows/embedded_prefect.py):
    Prefect's module gets a ``subprocess`` whose ``Popen`` is :func:`_guarded_popen`."""
    from prefect.server.api import server

    # A private touch of Prefect, checked at start (ephemeral.flows.prefect_private).
    if getattr(server.subprocess, "ephemeral_guarded", False):
        return
    guarded = types.ModuleType("subprocess")
    guarded.__dict__.update(vars(subprocess))
    guarded.Popen = _guarded_popen  # type: ignore[attr-defined]
    guarded.ephemeral_guarded = True  # type: ignore[attr-defined]
    server.subprocess = guarded
