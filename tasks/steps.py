"""One task per model call and per tool call (never finer: Prefect records every task)."""

from __future__ import annotations

from prefect import task

from ephemeral.agent import AgentRun
from ephemeral.providers.base import ModelReply, ToolCall
from ephemeral.tasks._common import TASK_OPTIONS


@task(name="model_step", **TASK_OPTIONS)
async def model_step(run: AgentRun) -> ModelReply | None:
    # Transient provider errors are retried inside the step, within the run's deadline
    # (ephemeral.retry), so Prefect-level retries stay off.
    return await run.model_step()


@task(name="shell_step", **TASK_OPTIONS)
async def shell_step(run: AgentRun, call: ToolCall) -> None:
    # Never retried: a shell command has side effects.
    await run.tool_step(call)
