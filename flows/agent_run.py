"""The ``agent-run`` flow: load, provision, one task per agent turn (or one for an agent run's
program), teardown, settle.

Only the run id is a flow parameter: Prefect's database stores parameters, and prompts and
outputs must not land there (zero data retention would leak through it). The executor that
starts the flow passes the run's handle in with that id (:class:`RunId`): the body drives the
run through the engine that granted its slot, and looks nothing up.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, TypeVar, cast

from prefect import flow
from prefect.settings import get_current_settings
from prefect.utilities.annotations import quote

from ephemeral.agent.loop import AgentRun, Steps
from ephemeral.engine import exits
from ephemeral.engine.executor import RunHandle
from ephemeral.engine.exits import Exit
from ephemeral.engine.runtime import Runtime
from ephemeral.sandbox.reaper import reap
from ephemeral.settings import Settings
from ephemeral.tasks.run import load_run, settle
from ephemeral.tasks.sandbox import provision_sandbox, teardown
from ephemeral.tasks.steps import agent_command, agent_turn

T = TypeVar("T")


def _q(value: T) -> T:
    """``quote(value)``: the task receives ``value`` itself, unwalked (typed as such)."""
    return cast(T, quote(value))


# quote(): Prefect walks every task argument looking for futures to resolve; a run is a deep
# object graph (messages, store, sandbox) and walking it cost ~140 ms per run.
FLOW_STEPS = Steps(
    provision=lambda run: provision_sandbox(_q(run)),
    # Within a turn the calls are plain: the turn is the task. Setup and verify are plain
    # too: a task each would cost Prefect's server a task run for a step most runs skip.
    model_step=AgentRun.model_step,
    tool_step=AgentRun.tool_step,
    turn=lambda run: agent_turn(_q(run)),
    agent=lambda run: agent_command(_q(run)),
    teardown=lambda run: teardown(_q(run)),
    settle=lambda run: settle(_q(run)),
)


class RunId(str):
    """A run's id carrying its :class:`~ephemeral.engine.executor.RunHandle` into the flow body.

    Prefect stores a flow's parameters in its database; this one is stored as what it is, the
    bare id (a ``str``), while the body takes the handle from it."""

    handle: RunHandle

    def __new__(cls, run: RunHandle) -> RunId:
        self = super().__new__(cls, run.run_id)
        self.handle = run
        return self


def _finish_elsewhere(exit: Exit) -> Any:
    """A hook for cancellation/crash: the run takes ``exit``. Prefect's runner calls it in a
    thread of its own after the flow's process is gone, so it finds the run (and through it the
    sandbox) from persisted state only.

    Where the flow ran in this process (``serve``, ``run``, ``eval``: an executor started it),
    Prefect's flow engine calls the hook on the loop that drives the run, and the engine on that
    loop ends the run itself (its slot's task is the flow's); a second runtime here would race
    it, and ``asyncio.run`` cannot start on a running loop anyway."""

    def hook(flow: Any, flow_run: Any, state: Any) -> None:
        run_id = (flow_run.parameters or {}).get("run_id")
        if not run_id:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # the runner's thread: nothing of this process drives the run
        else:
            return

        async def alive(owner: str) -> bool:
            return owner != run_id

        async def finish() -> None:
            runtime = await Runtime.start(Settings.load(), recover=False)
            try:
                # its process is gone: so is anything of it but the sandboxes it owned
                await reap(runtime.settings, is_owner_alive=alive)
                await runtime.engine.end(run_id, exit)
            finally:
                await runtime.close()

        asyncio.run(finish())

    return hook


# Nothing of a run is persisted (persist_result=False), but without a storage of its own each
# flow run asks the server for its default result storage, twice, with a blocking request from a
# new synchronous client (an SSL context each): ~10 % of the serving process's CPU, measured.
# A path is resolved locally (a block would be read from the server).
_NO_RESULTS = Path(get_current_settings().results.local_storage_path)


@flow(
    name="agent-run",
    flow_run_name="{run_id}",
    # The id is ours (validation would also copy a RunId into a bare str, losing its handle).
    validate_parameters=False,
    persist_result=False,
    result_storage=_NO_RESULTS,
    log_prints=False,
    on_cancellation=[_finish_elsewhere(exits.cancelled())],
    on_crashed=[_finish_elsewhere(exits.crashed("the run's process died"))],
)
async def agent_run(run_id: str) -> str:
    owned: Runtime | None = None
    if isinstance(run_id, RunId):
        run: RunHandle = run_id.handle
    else:
        # A bare id: started outside an executor (a Prefect worker in a fresh process, by
        # hand), so the run gets a runtime of its own here.
        owned = await Runtime.start(Settings.load(), recover=False)
        run = owned.engine.handle(run_id)
    try:
        agent = await load_run(_q(run))
        if agent is None:
            return (await run.row()).status
        row = await run.drive(agent, FLOW_STEPS)
        return row.status
    finally:
        if owned is not None:
            await owned.close()
