"""How a run that got an execution slot is carried out: the seam between the core and Prefect.

The :class:`~ephemeral.service.Runtime` admits a run, holds its slot, watches it and settles it
if anything escapes; an :class:`Executor` does what lies between. The core ships only
:class:`PlainExecutor` (the steps called in turn on this loop). Entry points choose: the
Prefect ``agent-run`` flow executor lives with the flows (``ephemeral.flows.executor``), and so
does the one that dispatches runs to Prefect task workers on other hosts
(``ephemeral.flows.dispatch``). The core never imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ephemeral.service import Runtime


class Executor(Protocol):
    async def execute(self, runtime: Runtime, run_id: str) -> None:
        """Carry the run from ``queued`` to settled; called holding one of the runtime's slots.

        Start with ``runtime.grant(run_id)`` (False: the run no longer waits; do nothing) and
        end with the run settled, or raise: the runtime then settles it ``infra_error``.
        """
        ...

    async def close(self) -> None:
        """Release what the executor holds; called once by ``Runtime.close``."""
        ...


@runtime_checkable
class Dispatcher(Protocol):
    """An executor that hands runs to other processes (``EPHEMERAL_EXECUTOR=prefect``).

    A runtime built with one admits runs without an owner (a worker claims each), seals a
    zero-data-retention prompt into the store for that worker, answers ``submit`` by calling
    :meth:`dispatch` (nothing executes in its process) and cancels through the store.
    """

    async def dispatch(self, run_id: str) -> None:
        """Hand the admitted run to a worker; return once it is queued there."""
        ...


class PlainExecutor:
    """The run's steps called in turn on the runtime's loop: no Prefect anywhere."""

    async def execute(self, runtime: Runtime, run_id: str) -> None:
        if not await runtime.grant(run_id):
            return
        await runtime.run_agent(await runtime.build(run_id))

    async def close(self) -> None:
        return None
