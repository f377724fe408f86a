"""The CLI against a server (``EPHEMERAL_URL`` set): the local runs' timeline and exit codes."""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx

from ephemeral import errors
from ephemeral.cli import exit_codes
from ephemeral.cli.output import err, fail, out, print_event
from ephemeral.client import Client
from ephemeral.policy import RunRequest
from ephemeral.settings import Settings


def run_remote(
    settings: Settings, requests: list[tuple[RunRequest, dict[str, Any]]], as_json: bool
) -> int:
    """Start each run on the server, print its timeline live, return the worst exit code."""
    from rich.markdown import Markdown

    worst = 0
    try:
        with Client(settings) as client:
            for request, labels in requests:
                if labels:
                    err.print("note: run labels are not sent to a server", style="dim")
                run = client.runs.create(request=request)
                if not as_json:
                    out.print(f"[bold]{run['id']}[/bold] · {run['model']}")
                n = 0
                for ev in client.runs.events(run["id"], stream=True):
                    if ev.type == "run.output":
                        continue  # printed in full below
                    n += 1
                    if not as_json:
                        print_event(ev, n)
                run = client.runs.get(run["id"])
                if as_json:
                    sys.stdout.write(json.dumps(run, indent=2) + "\n")
                elif run.get("output"):
                    out.rule("output")
                    out.print(
                        Markdown(run["output"]) if out.is_terminal else run["output"], markup=False
                    )
                    out.rule()
                worst = max(worst, exit_codes.for_status(run["status"]))
    except errors.EphemeralError as exc:
        raise fail(exc) from exc
    except httpx.HTTPError as exc:
        raise fail(_unreachable(settings, exc)) from exc
    return worst


def cancel_remote(settings: Settings, run_id: str) -> int:
    try:
        with Client(settings) as client:
            run = client.runs.cancel(run_id)
    except errors.EphemeralError as exc:
        raise fail(exc) from exc
    except httpx.HTTPError as exc:
        raise fail(_unreachable(settings, exc)) from exc
    out.print(run["status"])
    return 0


def _unreachable(settings: Settings, exc: httpx.HTTPError) -> errors.EphemeralError:
    return errors.EphemeralError(f"cannot reach the server at {settings.url}: {exc}")
