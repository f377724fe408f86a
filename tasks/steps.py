"""One task per agent turn (the model call and the shell commands it asked for), or one for an
agent run's program.

Never finer: Prefect's server records every task run (a row and three states), and on this
box that recording, not the run's own work, was what capped the runs per second (docs/deploy.md).
"""

from __future__ import annotations

from prefect import task

from ephemeral.agent.loop import AgentRun, take_turn
from ephemeral.tasks._common import TASK_OPTIONS


@task(name="agent_turn", **TASK_OPTIONS)
async def agent_turn(run: AgentRun) -> bool:
    # Transient provider errors are retried inside the model call, within the run's deadline
    # (ephemeral.agent.retry), and a shell command is never retried (it has side effects), so
    # Prefect-level retries stay off. Every call has its own deadline (ephemeral.agent.loop).
    return await take_turn(run)


@task(name="agent_command", **TASK_OPTIONS)
async def agent_command(run: AgentRun) -> None:
    # An agent run's one step: its program, start to exit (ephemeral.agent.command). Never
    # retried: the program has side effects, and its model calls were charged.
    await run.agent_step()
