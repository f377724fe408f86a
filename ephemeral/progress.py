"""What a process is waiting for while it starts: Prefect's server, an image build, the pool.

These waits take seconds to minutes before a run's first event, and say nothing on their own.
The code that waits calls :func:`stage` with one short line; the entry point decides where it
goes by :func:`listen` (``ephemeral run``/``eval``: stderr, a spinner on a terminal;
``ephemeral serve``: its log). With no listener the line is logged at INFO on
``ephemeral.progress``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("ephemeral.progress")

Listener = Callable[[str], None]
_listener: Listener | None = None


def stage(text: str) -> None:
    """Announce that this process now waits for ``text`` (e.g. "starting Prefect's server")."""
    if _listener is not None:
        _listener(text)
    else:
        log.info("%s", text)


def listen(listener: Listener | None) -> Listener | None:
    """Send every stage to ``listener`` (None: back to the log); returns the one it replaces.
    Process-wide, not per task: the stages of start-up come from several tasks."""
    global _listener
    previous, _listener = _listener, listener
    return previous
