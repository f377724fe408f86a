"""Zero-data-retention custody: a run's prompt and output, held for their one reader.

A run with ``zero_data_retention`` stores neither its prompt nor its output. Its prompt is held
from admission until the run's build, its output from the run's close until the first read of
the settled run; each is taken once, then forgotten. When the reader is in this process the
content stays in memory; when it is in another (a run dispatched to a worker, the output of a
run a worker executed) it is sealed in the store with the shared key (``store.sealed.put``),
deleted at that read or after ``zdr_ttl_seconds``.

One :class:`Custody` per engine holds it all; a :class:`~ephemeral.engine.run.Run` hands its output
over through :meth:`Custody.deliver` before its close, so whoever sees it settled finds it here.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from ephemeral.ids import utcnow

if TYPE_CHECKING:
    from ephemeral.settings import Settings
    from ephemeral.store import Store


class Custody:
    """Zero-data-retention prompts and outputs of the runs of one engine."""

    def __init__(self, settings: Settings, store: Store, sealing: Callable[[], bool]) -> None:
        self.settings = settings
        self.store = store
        # True when this process executes runs for readers in other processes (a worker):
        # outputs are sealed in the store then.
        self._sealing = sealing
        self._prompts: dict[str, str] = {}
        self._outputs: dict[str, str] = {}

    # prompts -------------------------------------------------------------------------------
    async def keep_prompt(self, run_id: str, prompt: str, *, elsewhere: bool) -> None:
        """Hold an admitted run's prompt for its build: here, or sealed when another process
        builds it (``elsewhere``: a dispatched run)."""
        if elsewhere:
            await self._seal(run_id, "prompt", prompt)
        else:
            self._prompts[run_id] = prompt

    async def take_prompt(self, run_id: str) -> str | None:
        """The prompt, for the build, once: from memory, or sealed by the process that
        admitted the run."""
        prompt = self._prompts.pop(run_id, None)
        return prompt if prompt is not None else await self._unseal(run_id, "prompt")

    def forget(self, run_id: str) -> None:
        """The run no longer waits to be built here: a prompt it never took goes."""
        self._prompts.pop(run_id, None)

    # outputs -------------------------------------------------------------------------------
    async def deliver(self, run_id: str, output: str) -> None:
        """A closing run's output, for its one reader: here, or sealed on a worker."""
        if self._sealing():
            await self._seal(run_id, "output", output)
        else:
            self._outputs[run_id] = output

    async def receive(self, run_id: str) -> None:
        """Take into memory an output a worker sealed (its run's reader is in this process)."""
        output = await self._unseal(run_id, "output")
        if output is not None:
            self._outputs[run_id] = output

    def take_output(self, run_id: str) -> str | None:
        """The output held in memory, delivered once, then forgotten."""
        return self._outputs.pop(run_id, None)

    async def take_or_unseal_output(self, run_id: str, zdr: bool) -> str | None:
        """The output for its first reader only: from memory, or sealed by the worker that
        ran it (``zdr``: the run keeps zero data, so a sealed one may wait)."""
        output = self.take_output(run_id)
        if output is None and zdr:
            output = await self._unseal(run_id, "output")
        return output

    # sealed in the store -------------------------------------------------------------------
    async def _seal(self, run_id: str, kind: str, text: str) -> None:
        from ephemeral.broker.secrets import Sealer

        token = Sealer.for_settings(self.settings).seal({"text": text})
        expires = utcnow() + timedelta(seconds=self.settings.zdr_ttl_seconds)
        await self.store.sealed.put(run_id, kind, token, expires)

    async def _unseal(self, run_id: str, kind: str) -> str | None:
        """Whoever calls first gets it, once."""
        from ephemeral.broker.secrets import Sealer

        token = await self.store.sealed.take(run_id, kind)
        if token is None:
            return None
        return Sealer.for_settings(self.settings).open(token).get("text")
