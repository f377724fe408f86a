"""How a run that got an execution slot is carried out: the seam between the core and Prefect.

The engine (``ephemeral.engine.engine``) admits a run, holds its slot, watches it and settles it if
anything escapes; an :class:`Executor` does what lies between, through a :class:`RunHandle`
(never the runtime). The core ships only :class:`PlainExecutor` (the steps called in turn on
this loop). :func:`ephemeral.flows.executor.executor_for` picks one from
``EPHEMERAL_EXECUTOR``: ``plain``, ``flow`` (each run an ``agent-run`` flow run in this
process, ``ephemeral.flows.executor``) or ``dispatch`` (each run handed to a Prefect task
worker on some host, ``ephemeral.flows.dispatch``). The core never imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ephemeral.agent.loop import PLAIN_STEPS, AgentRun, Steps

if TYPE_CHECKING:
    import asyncio

    from ephemeral.store import RunRow, Store


class RunHandle(Protocol):
    """One run, as an executor sees it (the engine's: ``engine.engine.EngineRunHandle``)."""

    run_id: str

    @property
    def started(self) -> asyncio.Event:
        """Set once the run's body began: from then on, starting it again would repeat work."""
        ...

    def restart(self) -> None:
        """A fresh ``started``, before another attempt to start the body."""
        ...

    async def grant(self) -> bool:
        """``queued → provisioning`` (its clock starts); False: it no longer waits, do nothing."""
        ...

    async def build(self) -> AgentRun | None: ...

    async def drive(self, agent: AgentRun, steps: Steps) -> RunRow: ...

    async def run(self, steps: Steps) -> RunRow:
        """Build and drive the steps to the close and record."""
        ...

    async def row(self) -> RunRow:
        """The run's row as stored now."""
        ...

    async def dispatch(self) -> None: ...

    async def done(self) -> RunRow:
        """Wait until the run is settled, by whichever process executes it."""
        ...

    async def cancel(self) -> RunRow: ...


class Executor(Protocol):
    async def execute(self, run: RunHandle) -> None:
        """Carry the run from ``queued`` to settled; called holding one of the engine's slots.

        Start with ``run.grant()`` (False: the run no longer waits; do nothing) and end with the
        run settled, or raise: the engine then settles it ``infra_error``.
        """
        ...

    async def close(self) -> None:
        """Release what the executor holds; called once by ``Runtime.close``."""
        ...


@runtime_checkable
class Dispatcher(Protocol):
    """An executor that hands runs to other processes (``EPHEMERAL_EXECUTOR=dispatch``).

    A runtime built with one admits runs without an owner (a worker takes each), seals a
    zero-data-retention prompt into the store for that worker, answers ``submit`` by calling
    :meth:`dispatch` (nothing executes in its process) and cancels through the store.
    """

    async def dispatch(self, store: Store, run_id: str) -> None:
        """Hand the admitted run to a worker; return once it is queued there. ``store``: the
        dispatching runtime's, where the hand-over is marked (ephemeral.outbox)."""
        ...


class PlainExecutor:
    """The run's steps called in turn on the engine's loop: no Prefect anywhere."""

    async def execute(self, run: RunHandle) -> None:
        if await run.grant():
            await run.run(PLAIN_STEPS)

    async def close(self) -> None:
        return None
