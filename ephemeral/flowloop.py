"""Execution on a second event loop, for servers: admission and streaming keep their own loop.

Prefect's flow engine does blocking work on the loop that awaits it (creating an SSL context per
client, reading result storage: 0.4-1.1 s per step measured under load), so a server must not run
flows on the loop that answers HTTP. :func:`start_bridged` returns a runtime for the caller's
loop whose runs execute on an inner runtime living on a :class:`FlowLoop`; everything that has
to cross between the two loops is in this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar, cast

from ephemeral.executor import Executor, RunHandle
from ephemeral.lifecycle import TERMINAL_STATUSES
from ephemeral.service import Runtime
from ephemeral.settings import Settings
from ephemeral.store import RunRow

T = TypeVar("T")


class FlowLoop:
    """An event loop in its own thread. The inner runtime living here has its own store engine
    and warm pool: asyncio resources belong to the loop that made them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="ephemeral-flows", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class LoopBridge:
    """The outer runtime's executor: hands each run to the inner runtime on the flow loop."""

    def __init__(self, flow_loop: FlowLoop, inner: Runtime) -> None:
        self.flow_loop = flow_loop
        self.inner = inner

    async def execute(self, run: RunHandle) -> None:
        await self.flow_loop.call(self.inner.execute(run.run_id))

    async def close(self) -> None:
        await self.flow_loop.call(self.inner.close())
        self.flow_loop.stop()


class LoopBridgedRuntime(Runtime):
    """Admits, streams, cancels and watches on the caller's loop; runs execute on the inner
    runtime, so what lives with an executing run (a zero-data-retention prompt and output,
    the run's agent and task) is reached there."""

    @property
    def bridge(self) -> LoopBridge:
        return cast(LoopBridge, self.executor)

    def keep_prompt(self, run_id: str, prompt: str) -> None:
        # A plain dict write from this thread; the inner loop reads it only once it executes.
        self.bridge.inner.keep_prompt(run_id, prompt)

    def take_zdr_output(self, run_id: str) -> str | None:
        return super().take_zdr_output(run_id) or self.bridge.inner.take_zdr_output(run_id)

    async def cancel(self, run_id: str, org_id: str | None = None) -> RunRow:
        row = await self.store.get_run(run_id, org_id)
        if row.status in TERMINAL_STATUSES:
            return row
        await self.bridge.flow_loop.call(self.bridge.inner.cancel(run_id, org_id))
        outer = self.engine.task(run_id)
        if outer is not None:
            # Done, or still waiting here for a slot: the run is closed either way.
            outer.cancel()
            with contextlib.suppress(BaseException):
                await outer
        return await self.store.get_run(run_id)

    async def _stop(self, run_id: str, task: asyncio.Task[RunRow]) -> None:
        inner_task = await self.bridge.flow_loop.call(_task_of(self.bridge.inner, run_id))
        if inner_task is not None:
            self.bridge.flow_loop.loop.call_soon_threadsafe(inner_task.cancel)
        await super()._stop(run_id, task)


async def start_bridged(
    settings: Settings, executor: Executor, *, warm_pool: bool = False, recover: bool = True
) -> Runtime:
    """A runtime for this loop whose runs ``executor`` executes on a new :class:`FlowLoop`."""
    flow_loop = FlowLoop()
    inner = await flow_loop.call(
        # The outer runtime watches: it owns the task of every run it launched.
        Runtime.start(
            settings, executor=executor, warm_pool=warm_pool, recover=False, watchdog=False
        )
    )
    return await LoopBridgedRuntime.start(
        settings, executor=LoopBridge(flow_loop, inner), recover=recover
    )


async def _task_of(runtime: Runtime, run_id: str) -> asyncio.Task[RunRow] | None:
    return runtime.engine.task(run_id)
