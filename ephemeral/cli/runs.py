"""CLI group: run, cancel, record (the embedded default; no server to start by hand)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markdown import Markdown

from ephemeral import errors
from ephemeral.cli import exits
from ephemeral.cli.output import err, fail, out, print_event
from ephemeral.ids import rfc3339, utcnow
from ephemeral.money import parse_usd
from ephemeral.policy import RunRequest
from ephemeral.settings import Settings


async def _run_local(
    settings: Settings, requests: list[tuple[RunRequest, dict[str, Any]]], as_json: bool
) -> int:
    from ephemeral.flows.executor import executor_for
    from ephemeral.runview import run_object
    from ephemeral.service import Runtime

    runtime = await Runtime.start(settings, executor=executor_for(settings))
    worst = 0
    try:
        org_id = await runtime.local_org()
        for request, labels in requests:
            row, _ = await runtime.admit(org_id, request, labels=labels)
            task = runtime.launch(row.id)
            if not as_json:
                out.print(f"[bold]{row.id}[/bold] · {row.model}")
            n = 0
            async for ev in runtime.events(row.id, follow=True):
                if ev.type == "run.output":
                    continue  # printed in full below
                n += 1
                if not as_json:
                    print_event(ev, n)
            row = await task
            output = row.output if row.output is not None else runtime.take_zdr_output(row.id)
            if as_json:
                obj = run_object(row)
                obj["output"] = output
                sys.stdout.write(json.dumps(obj, indent=2) + "\n")
            elif output:
                out.rule("output")
                out.print(Markdown(output) if out.is_terminal else output, markup=False)
                out.rule()
            worst = max(worst, exits.for_status(row.status))
    finally:
        await runtime.close()
    return worst


def _requests_from_recipe(
    path: Path, settings: Settings
) -> list[tuple[RunRequest, dict[str, Any]]]:
    from ephemeral.recipes import expand, load_recipe

    recipe = load_recipe(path)
    planned = expand(recipe, default_model=settings.default_model)
    out_list = []
    for p in planned:
        req = RunRequest(prompt=p.prompt, model=p.model, **p.policy.model_dump())
        out_list.append((req, {"recipe": p.recipe, "cell": p.cell, "repeat_index": p.repeat_index}))
    return out_list


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run(
        recipe: Annotated[Path | None, typer.Argument(help="A recipe YAML file.")] = None,
        prompt: Annotated[str | None, typer.Option(help="The task, instead of a recipe.")] = None,
        model: Annotated[
            str | None, typer.Option(help="provider/name; default EPHEMERAL_DEFAULT_MODEL.")
        ] = None,
        web: Annotated[bool, typer.Option("--web/--no-web")] = False,
        shell: Annotated[bool, typer.Option("--shell/--no-shell")] = True,
        timeout: Annotated[int, typer.Option(help="Time limit in seconds (1-3600).")] = 120,
        budget: Annotated[str, typer.Option(help="Hard cap in dollars, e.g. 0.04.")] = "0.04",
        isolation: Annotated[
            str, typer.Option(help="auto, gvisor, namespaces, microvm, microvm-tcg.")
        ] = "auto",
        zero_data_retention: Annotated[bool, typer.Option("--zero-data-retention")] = False,
        image: Annotated[
            str | None, typer.Option(help="A built image (ephemeral images list); default image.")
        ] = None,
        as_json: Annotated[
            bool, typer.Option("--json", help="Print the run object as JSON.")
        ] = False,
        no_prefect: Annotated[
            bool, typer.Option("--no-prefect", help="Run the steps without Prefect.")
        ] = False,
    ) -> None:
        """Run one agent task (or every run a recipe expands to) and print its timeline live.

        Exit status: 0 succeeded, 1 failed, 2 bad input, 3 error, 4 timed out, 5 budget
        exhausted, 6 cancelled; the highest of several runs (see Exit status above).
        """
        settings = Settings.load(**({"use_prefect": False} if no_prefect else {}))
        try:
            if recipe is not None:
                if prompt is not None:
                    raise errors.InvalidRequest.field(
                        "prompt", "give a recipe or --prompt, not both"
                    )
                requests = _requests_from_recipe(recipe, settings)
            elif prompt is not None:
                requests = [
                    (
                        RunRequest.model_validate(
                            {
                                "prompt": prompt,
                                "model": model,
                                "web": web,
                                "shell": shell,
                                "timeout_seconds": timeout,
                                "max_cost_micros": parse_usd(budget, field="--budget"),
                                "isolation": isolation,
                                "zero_data_retention": zero_data_retention,
                                "image": image,
                            }
                        ),
                        {},
                    )
                ]
            else:
                raise errors.InvalidRequest.field("prompt", "give a recipe file or --prompt")
        except errors.EphemeralError as exc:
            raise fail(exc) from exc
        except ValueError as exc:  # pydantic validation: name the field
            raise fail(_validation_error(exc)) from exc
        if settings.url:
            from ephemeral.cli.remote import run_remote

            raise typer.Exit(run_remote(settings, requests, as_json))
        if settings.use_prefect or settings.executor == "prefect":
            from ephemeral.prefect_setup import configure

            configure(settings)
        try:
            code = asyncio.run(_run_local(settings, requests, as_json))
        except errors.EphemeralError as exc:
            raise fail(exc) from exc
        raise typer.Exit(code)

    @app.command("record")
    def record(
        run_id: str,
        output: Annotated[
            Path | None, typer.Option("-o", "--output", help="Cassette file to write.")
        ] = None,
    ) -> None:
        """Capture a finished run's model turns as a replay cassette (model ``replay/<name>``)."""
        settings = Settings.load()

        async def go() -> dict[str, Any]:
            from ephemeral.store import Store

            store = await Store.open(settings.db_url)
            try:
                row = await store.get_run(run_id)
                turns = await store.get_transcript(run_id)
            finally:
                await store.close()
            if not turns:
                raise errors.NotFound(
                    f"run {run_id} has no recorded model turns (zero data retention or erased)"
                )
            return {
                "version": 1,
                "model": row.model,
                "recorded_at": rfc3339(utcnow()),
                "source_run": run_id,
                "turns": turns,
            }

        try:
            cassette = asyncio.run(go())
        except errors.EphemeralError as exc:
            raise fail(exc) from exc
        text = json.dumps(cassette, indent=2) + "\n"
        if output is None:
            sys.stdout.write(text)
        else:
            output.write_text(text)
            err.print(f"wrote {output} ({len(cassette['turns'])} turns)")

    @app.command("cancel")
    def cancel(run_id: str) -> None:
        """Cancel a run: its sandbox is destroyed and it settles ``cancelled`` (idempotent)."""
        settings = Settings.load()
        if settings.url:
            from ephemeral.cli.remote import cancel_remote

            raise typer.Exit(cancel_remote(settings, run_id))

        async def go() -> str:
            from ephemeral.service import Runtime

            runtime = await Runtime.start(settings)
            try:
                return (await runtime.cancel(run_id)).status
            finally:
                await runtime.close()

        try:
            out.print(asyncio.run(go()))
        except errors.EphemeralError as exc:
            raise fail(exc) from exc


def _validation_error(exc: ValueError) -> errors.InvalidRequest:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        items = [
            {"field": ".".join(str(p) for p in e["loc"]) or "body", "message": e["msg"]}
            for e in exc.errors()
        ]
        return errors.InvalidRequest("invalid request", errors=items)
    return errors.InvalidRequest(str(exc))
