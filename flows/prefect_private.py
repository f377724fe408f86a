"""Every part of Prefect Ephemeral uses beyond its public API, named here and checked when a
process that uses Prefect starts (``ephemeral.flows.embedded_server.configure``).

Prefect's public API is what its API reference documents: ``TaskWorker`` (``execute_task_run``,
``task_keys``, ``client_id``, used as an async context manager), ``prefect.client.subscriptions
.Subscription``, ``get_client``, flows, tasks, ``ContextModel.model_copy``... Where it offers
nothing for what a part needs, the part touches a private one, and that touch is listed in
:data:`TOUCHES` with why: :func:`check` fails with :class:`~ephemeral.errors.PrefectIncompatible`
naming the attribute when it is missing or changed, and when the installed Prefect is not a
version in :data:`TESTED_PREFECT` (the exact pin in ``pyproject.toml`` is what holds them
today; this is what says so when someone lifts it). docs/deploy.md lists the same touches.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from importlib.metadata import version

from ephemeral import errors

# Prefect versions the touches below were read and tested against (the suite on each).
TESTED_PREFECT: tuple[str, ...] = ("3.9.1",)


@dataclass(frozen=True)
class Touch:
    """One private part of Prefect (or of httpx under it) that a part of Ephemeral relies on."""

    name: str  # the attribute, fully named
    used_by: str  # the function that touches it
    why: str  # what it is for, and why no public API does it
    check: Callable[[], str | None]  # None when it is as expected, else what is wrong
    embedded_only: bool = False  # touched only with Prefect's embedded server


def _client_context_vars() -> str | None:
    from prefect.context import AsyncClientContext, SyncClientContext

    for cls in (AsyncClientContext, SyncClientContext):
        if not isinstance(getattr(cls, "__var__", None), ContextVar):
            return f"{cls.__name__}.__var__ is not a ContextVar"
    return None


def _sets_attribute(init: Callable[..., object], attribute: str) -> bool:
    """``init`` assigns ``self.<attribute>`` (an instance attribute: no class has it to inspect;
    a client made to look costs ~0.3 s of SSL setup, so its constructor's source is read)."""
    try:
        source = inspect.getsource(init)
    except (OSError, TypeError):
        return False
    return f"self.{attribute} =" in source or f"self.{attribute}:" in source


def _client_transport() -> str | None:
    import httpx
    from prefect.client.orchestration import PrefectClient

    if not _sets_attribute(PrefectClient.__init__, "_client"):
        return "PrefectClient.__init__ no longer sets self._client (its httpx client)"
    if not _sets_attribute(httpx.AsyncClient.__init__, "_transport"):
        return "httpx.AsyncClient.__init__ no longer sets self._transport"
    params = list(inspect.signature(httpx.AsyncBaseTransport.handle_async_request).parameters)
    if params != ["self", "request"]:
        return f"httpx.AsyncBaseTransport.handle_async_request takes {params}"
    return None


def _server_subprocess() -> str | None:
    import subprocess

    from prefect.server.api import server

    module = getattr(server, "subprocess", None)
    if not inspect.ismodule(module) or not hasattr(module, "Popen"):
        return "prefect.server.api.server.subprocess is not a module with Popen"
    if module is not subprocess and not getattr(module, "ephemeral_guarded", False):
        return "prefect.server.api.server.subprocess is neither subprocess nor our guard"
    try:
        source = inspect.getsource(server.SubprocessASGIServer)
    except (AttributeError, OSError, TypeError):
        return "prefect.server.api.server.SubprocessASGIServer is gone"
    if "subprocess.Popen(" not in source or '"uvicorn"' not in source:
        return "SubprocessASGIServer no longer starts `python -m uvicorn` via subprocess.Popen"
    return None


TOUCHES: tuple[Touch, ...] = (
    Touch(
        "prefect.context.AsyncClientContext.__var__, SyncClientContext.__var__",
        "ephemeral.flows.executor.FlowExecutor.execute",
        "Every flow run of the executor shares one Prefect client: the context variable the "
        "flow engine reads it from is set in each run's own task. Entering the context (the "
        "public way) would enter and close the shared synchronous client per run.",
        _client_context_vars,
    ),
    Touch(
        "prefect.client.orchestration.PrefectClient._client, httpx.AsyncClient._transport",
        "ephemeral.flows.prefect_client.retry_when_busy",
        "The embedded server's SQLite answers 503 to colliding writes; the client's transport is "
        "wrapped to retry in milliseconds. Prefect's public httpx_settings={'transport': ...} "
        "makes a client the flow engine's get_client() does not match (a new client per run).",
        _client_transport,
        embedded_only=True,
    ),
    Touch(
        "prefect.server.api.server.subprocess",
        "ephemeral.flows.embedded_server.guard_embedded_server",
        "Prefect stops its embedded server only at exit (atexit), which SIGKILL never runs; the "
        "server module's subprocess is swapped so that its `python -m uvicorn` becomes "
        "`python -m ephemeral.embedded_prefect`, which ends with its parent. Prefect offers no "
        "option for the server's command or lifetime.",
        _server_subprocess,
        embedded_only=True,
    ),
)


def problems(*, embedded: bool = True, touches: tuple[Touch, ...] = TOUCHES) -> list[str]:
    """What does not hold in the installed Prefect: each names the attribute and its user."""
    found = []
    installed = version("prefect")
    if installed not in TESTED_PREFECT:
        found.append(
            f"Prefect {installed} is not a version Ephemeral was tested with "
            f"({', '.join(TESTED_PREFECT)})"
        )
    for touch in touches:
        if touch.embedded_only and not embedded:
            continue
        try:
            wrong = touch.check()
        except Exception as exc:  # noqa: BLE001 - an import that fails is a missing part too
            wrong = f"{type(exc).__name__}: {exc}"
        if wrong is not None:
            found.append(f"{touch.name} (used by {touch.used_by}): {wrong}")
    return found


def check(*, embedded: bool = True, touches: tuple[Touch, ...] = TOUCHES) -> None:
    """Fail unless every private part this process will touch is as expected."""
    found = problems(embedded=embedded, touches=touches)
    if found:
        raise errors.PrefectIncompatible(
            "the installed Prefect does not have what Ephemeral uses beyond its public API "
            "(ephemeral/flows/prefect_private.py, docs/deploy.md): " + "; ".join(found)
        )
