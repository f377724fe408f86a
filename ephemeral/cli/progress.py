"""Start-up stages (:mod:`ephemeral.progress`) on stderr while a command waits for its first run.

On a terminal a spinner names the current stage until the run's timeline begins (:func:`quiet`);
in a pipe or a log, and after that, each stage is one plain line, ``ephemeral: <stage>``.
stderr either way, so ``--json`` on stdout stays one clean document.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from rich.console import Console
from rich.status import Status

from ephemeral import progress
from ephemeral.cli.output import err

if TYPE_CHECKING:
    from ephemeral.settings import Settings

PREFIX = "ephemeral: "
_current: Announcer | None = None


class Announcer:
    def __init__(self, console: Console, show: Callable[[str], None] | None = None) -> None:
        self.console = console
        self.show = show  # e.g. a progress bar's status field, which already holds the terminal
        self._status: Status | None = None
        self._spin = console.is_terminal

    def __call__(self, text: str) -> None:
        if self.show is not None:
            self.show(text)
        elif not self._spin:
            self.console.print(PREFIX + text, markup=False)
        elif self._status is None:
            self._status = self.console.status(text)
            self._status.start()
        else:
            self._status.update(text)

    def stop(self) -> None:
        self._spin = False
        if self._status is not None:
            self._status.stop()
            self._status = None


@contextlib.contextmanager
def announcing(
    console: Console = err, show: Callable[[str], None] | None = None
) -> Iterator[Announcer]:
    """Print the stages announced inside the block (see the module's docstring)."""
    global _current
    announcer = Announcer(console, show)
    previous, outer = progress.listen(announcer), _current
    _current = announcer
    try:
        yield announcer
    finally:
        announcer.stop()
        progress.listen(previous)
        _current = outer


def quiet() -> None:
    """The run's own timeline begins: stop the spinner (a later stage prints as a line)."""
    if _current is not None:
        _current.stop()


def start_prefect(settings: Settings) -> None:
    """Configure Prefect and start its embedded server now, saying so first: importing Prefect
    alone takes seconds, its server many more (nothing under ``EPHEMERAL_EXECUTOR=plain``)."""
    if settings.executor == "plain":
        return
    # announced before Prefect is imported (seconds), so a line comes within a second
    progress.stage("loading Prefect (--no-prefect runs without it)")
    from ephemeral.api.app import start_prefect_server
    from ephemeral.flows.embedded_server import configure

    configure(settings)
    start_prefect_server()  # nothing to start under PREFECT_API_URL
