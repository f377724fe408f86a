"""CLI group: run, cancel, record (the embedded default; no server to start by hand)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markdown import Markdown
from rich.markup import escape

from ephemeral import errors
from ephemeral.cli import exit_codes
from ephemeral.cli.output import err, fail, out, print_event
from ephemeral.cli.progress import announcing, quiet, start_prefect
from ephemeral.lifecycle import RunStatus
from ephemeral.money.amounts import parse_usd, usd
from ephemeral.policy import RunRequest
from ephemeral.settings import Settings


async def _run_local(
    settings: Settings, requests: list[tuple[RunRequest, dict[str, Any]]], as_json: bool
) -> int:
    from ephemeral.engine.runtime import Runtime
    from ephemeral.flows.executor import executor_for
    from ephemeral.runview import run_object

    runtime = await Runtime.start(settings, executor=executor_for(settings))
    worst = 0
    try:
        org_id = await runtime.local_org()
        for request, labels in requests:
            row, _ = await runtime.admit(org_id, request, labels=labels)
            task = runtime.launch(row.id)
            quiet()
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
            else:
                _print_output(output)
                if row.status != RunStatus.SUCCEEDED and row.termination_detail:
                    # why it ended (a replay asked another prompt, a provider's refusal, …)
                    err.print(
                        f"{row.status}: {row.termination_reason}: {row.termination_detail}",
                        markup=False,
                    )
            worst = max(worst, exit_codes.for_status(row.status))
    finally:
        await runtime.close()
    return worst


async def _run_recipe(settings: Settings, path: Path, as_json: bool) -> int:
    """A recipe's runs through the evaluation path of ``ephemeral eval`` (its money cap, its
    checks on each run, its records), one at a time so each timeline prints live."""
    from ephemeral.engine.runtime import Runtime
    from ephemeral.evals.execute import Watchers, run_view_output
    from ephemeral.evals.plan import evaluation_for, resolve_path
    from ephemeral.evals.suite import run_evaluation
    from ephemeral.flows.executor import executor_for
    from ephemeral.recipes.recipe import Suite, load_any, validate_recipe

    if isinstance(load_any(resolve_path(str(path), settings)), Suite):
        raise errors.InvalidRequest.field(
            "RECIPE", f"{path} is a suite: run it with ephemeral eval"
        )
    evaluation = evaluation_for(str(path), settings, concurrency=1)
    for recipe in evaluation.recipes:  # a bad recipe fails here, before any run
        validate_recipe(recipe, settings)
    runtime = await Runtime.start(settings, executor=executor_for(settings))
    printed: asyncio.Task[None] | None = None

    async def follow(run_id: str, before: asyncio.Task[None] | None) -> None:
        if before is not None:
            await before
        quiet()
        if as_json:
            return
        out.print(f"[bold]{run_id}[/bold]")
        n = 0
        async for ev in runtime.events(run_id, follow=True):
            if ev.type != "run.output":  # printed in full once judged
                n += 1
                print_event(ev, n)

    def admitted(run_id: str) -> None:
        nonlocal printed
        printed = asyncio.create_task(follow(run_id, printed))

    def judged(row: Any, output: str | None, checks: list[Any]) -> None:
        if as_json:
            obj = run_view_output(row, output)
            obj["checks"] = [c.model_dump() for c in checks]
            sys.stdout.write(json.dumps(obj, indent=2) + "\n")
            return
        _print_output(output)
        for c in checks:
            mark = "[green]PASS[/green]" if c.passed else "[red]FAIL[/red]"
            out.print(f"{mark} {escape(c.check)}: {escape(c.reason or '')}")

    evaluation.watchers = Watchers(admitted=admitted, judged=judged)
    try:
        report = await run_evaluation(runtime, evaluation)
        if printed is not None:
            await printed
    finally:
        if printed is not None and not printed.done():
            printed.cancel()
        await runtime.close()
    worst = 0
    for result in report.results:
        if result.status == "skipped":  # the recipe's budget could not cover it
            if not as_json:
                err.print(f"skipped {escape(result.pair_key)}: {escape(result.detail or '')}")
            code = exit_codes.ExitCode.BUDGET_EXHAUSTED
        elif result.run_id is None:  # refused at admission, or it broke
            if not as_json:
                err.print(
                    f"{result.status} {escape(result.pair_key)}: {escape(result.detail or '')}"
                )
            code = exit_codes.ExitCode.ERROR
        else:
            code = exit_codes.for_status(result.status)
            if code == exit_codes.ExitCode.OK and not result.passed:  # a check failed
                code = exit_codes.ExitCode.FAILED
        worst = max(worst, int(code))
    return worst


def _print_output(output: str | None) -> None:
    if output:
        out.rule("output")
        out.print(Markdown(output) if out.is_terminal else output, markup=False)
        out.rule()


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run(
        recipe: Annotated[Path | None, typer.Argument(help="A recipe YAML file.")] = None,
        prompt: Annotated[str | None, typer.Option(help="The task, instead of a recipe.")] = None,
        model: Annotated[
            str | None,
            typer.Option(
                help="provider/name; default EPHEMERAL_DEFAULT_MODEL, else a model of the "
                "provider whose key is set (none: name one)."
            ),
        ] = None,
        web: Annotated[
            bool, typer.Option("--web/--no-web", help="Let the agent fetch web pages (broker).")
        ] = False,
        shell: Annotated[
            bool, typer.Option("--shell/--no-shell", help="Let the agent run shell commands.")
        ] = True,
        timeout: Annotated[int, typer.Option(help="Time limit in seconds (1-3600).")] = 120,
        budget: Annotated[str, typer.Option(help="Hard cap in dollars, e.g. 0.04.")] = "0.04",
        isolation: Annotated[
            str, typer.Option(help="auto, gvisor, namespaces, microvm, microvm-tcg.")
        ] = "auto",
        zero_data_retention: Annotated[
            bool,
            typer.Option(
                "--zero-data-retention", help="Keep no prompt, command or output of the run."
            ),
        ] = False,
        image: Annotated[
            str | None,
            typer.Option(help="A built image (ephemeral images list) or an OCI reference."),
        ] = None,
        disk_mib: Annotated[
            int | None,
            typer.Option(
                "--disk-mib",
                help="The sandbox's writable root (/ and /tmp) in MiB, up to "
                "EPHEMERAL_DISK_MAX_MIB; default 256.",
            ),
        ] = None,
        as_json: Annotated[
            bool, typer.Option("--json", help="Print the run object as JSON.")
        ] = False,
        no_prefect: Annotated[
            bool, typer.Option("--no-prefect", help="Run the steps without Prefect.")
        ] = False,
    ) -> None:
        """Run one agent task (or every run a recipe expands to) and print its timeline live.

        A recipe runs the way ephemeral eval runs it: one run at a time, never past the
        recipe's budget (a run that does not fit is skipped), each run judged by the
        recipe's checks. The other options describe a --prompt run; a recipe brings its own.

        Exit status: 0 succeeded, 1 failed (or a check failed), 2 bad input, 3 error, 4 timed
        out, 5 budget exhausted (or skipped for the recipe's budget), 6 cancelled; the highest
        of several runs.

        While it starts it says on stderr what it waits for (loading Prefect, starting its
        embedded server, opening the store, building an image): a spinner on a terminal, one
        line "ephemeral: <stage>" each in a pipe, before the timeline. With --json, stdout
        holds only the JSON.
        """
        settings = Settings.load(**({"executor": "plain"} if no_prefect else {}))
        try:
            if recipe is not None and prompt is not None:
                raise errors.InvalidRequest.field("--prompt", "give a recipe or --prompt, not both")
            if recipe is not None and settings.url:
                raise errors.InvalidRequest.field(
                    "EPHEMERAL_URL",
                    "a recipe runs on this host (its budget and checks apply); unset it",
                )
            if recipe is None:
                if prompt is None:
                    raise errors.InvalidRequest.field("--prompt", "give a recipe file or --prompt")
                request = RunRequest.model_validate(
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
                        "disk_mib": disk_mib,
                    }
                )
                if not settings.url:  # refused now, not after Prefect's server has started
                    from ephemeral.models import resolve_model

                    resolve_model(model, settings)
        except errors.EphemeralError as exc:
            raise fail(exc, flags=FLAGS) from exc
        except ValueError as exc:  # pydantic validation: name the flag
            raise fail(_validation_error(exc), flags=FLAGS) from exc
        if settings.url:
            from ephemeral.cli.remote import run_remote

            raise typer.Exit(run_remote(settings, [(request, {})], as_json))
        try:
            with announcing():
                start_prefect(settings)
                if recipe is not None:
                    code = asyncio.run(_run_recipe(settings, recipe, as_json))
                else:
                    code = asyncio.run(_run_local(settings, [(request, {})], as_json))
        except errors.EphemeralError as exc:
            raise fail(exc, flags=FLAGS) from exc
        raise typer.Exit(code)

    @app.command("record")
    def record(
        run_id: Annotated[str, typer.Argument(help="A finished run (run_...).")],
        output: Annotated[
            Path | None, typer.Option("-o", "--output", help="Cassette file to write.")
        ] = None,
    ) -> None:
        """Capture a finished run's model turns as a replay cassette: saved as NAME.json in
        EPHEMERAL_CASSETTES_DIR, it replays as model replay/NAME."""
        settings = Settings.load()

        async def go() -> dict[str, Any]:
            from ephemeral.engine.record import cassette_of_run
            from ephemeral.store import Store

            store = await Store.open(settings.db_url)
            try:
                return await cassette_of_run(store, run_id)
            finally:
                await store.close()

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
    def cancel(
        run_id: Annotated[str, typer.Argument(help="The run to cancel (run_...).")],
    ) -> None:
        """Cancel a run: its sandbox is destroyed and it settles as cancelled (idempotent)."""
        settings = Settings.load()
        if settings.url:
            from ephemeral.cli.remote import cancel_remote

            raise typer.Exit(cancel_remote(settings, run_id))

        async def go() -> str:
            from ephemeral.engine.runtime import Runtime

            runtime = await Runtime.start(settings)
            try:
                return (await runtime.cancel(run_id)).status
            finally:
                await runtime.close()

        try:
            out.print(asyncio.run(go()))
        except errors.EphemeralError as exc:
            raise fail(exc) from exc


# The run request's fields as ``ephemeral run`` spells them.
FLAGS = {
    "prompt": "--prompt",
    "model": "--model",
    "web": "--web",
    "shell": "--shell",
    "timeout_seconds": "--timeout",
    "max_cost_micros": "--budget",
    "isolation": "--isolation",
    "zero_data_retention": "--zero-data-retention",
    "image": "--image",
    "disk_mib": "--disk-mib",
}
_BOUNDS = {"le": "at most", "lt": "less than", "ge": "at least", "gt": "more than"}


def _validation_error(exc: ValueError) -> errors.InvalidRequest:
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return errors.InvalidRequest(str(exc))
    items = []
    for e in exc.errors():
        field = ".".join(str(p) for p in e["loc"]) or "body"
        message = e["msg"]
        bound = next((k for k in _BOUNDS if k in e.get("ctx", {})), None)
        if field.endswith("_micros") and bound is not None:  # the user typed dollars
            message = f"must be {_BOUNDS[bound]} {usd(int(e['ctx'][bound]))}"
        items.append({"field": field, "message": message})
    if len(items) == 1:
        return errors.InvalidRequest.field(items[0]["field"], items[0]["message"])
    return errors.InvalidRequest("invalid request", errors=items)
