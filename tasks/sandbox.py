"""Sandbox tasks: provision a fresh sandbox, tear it down."""

from __future__ import annotations

from prefect import task

from ephemeral.agent.loop import AgentRun
from ephemeral.tasks._common import TASK_OPTIONS


@task(name="provision_sandbox", **TASK_OPTIONS)
async def provision_sandbox(run: AgentRun) -> None:
    await run.provision()


@task(name="teardown", **TASK_OPTIONS)
async def teardown(run: AgentRun) -> None:
    await run.teardown()
