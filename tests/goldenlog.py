"""Golden event logs (the way Temporal's replay tests pin workflow histories): the shape of a
run's log, each event's type and the keys of its payload in order, compared with a stored file
in tests/golden/ (``<name>.log.json``). A change to what a run, a session or an agent run
writes shows up as a diff of that file: after an intended one, rewrite them with
``EPHEMERAL_UPDATE_GOLDEN=1`` and review the diff (tests/test_golden_timeline.py pins how a
log renders; these pin what is in it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from ephemeral.events import Event

GOLDEN = Path(__file__).resolve().parent / "golden"


# The agent loop's events: how many steps a run takes before its budget runs out depends on
# the compute it accrued meanwhile (wall time), so a log pinned with ``loop=True`` keeps each
# distinct step event of a stretch of them once (sorted), not how many there were.
LOOP = frozenset({"model.called", "shell.executed", "budget.warning"})


def log_shape(events: Sequence[Event], *, loop: bool = False) -> list[list[object]]:
    """``[type, [payload keys, sorted]]`` per event, in order (with ``loop``, each stretch of
    agent-loop events as its distinct shapes)."""
    shape: list[list[object]] = []
    stretch: list[list[object]] = []
    for e in events:
        row: list[object] = [e.type, sorted(e.data)]
        if loop and e.type in LOOP:
            if row not in stretch:
                stretch.append(row)
            continue
        shape += sorted(stretch, key=json.dumps)
        stretch = []
        shape.append(row)
    return shape + sorted(stretch, key=json.dumps)


def assert_golden_log(name: str, events: Sequence[Event], *, loop: bool = False) -> None:
    path = GOLDEN / f"{name}.log.json"
    shape = log_shape(events, loop=loop)
    got = "[\n" + ",\n".join(json.dumps(row) for row in shape) + "\n]\n"
    if os.environ.get("EPHEMERAL_UPDATE_GOLDEN"):
        path.write_text(got)
    assert path.is_file(), f"no golden log {path.name}: write it with EPHEMERAL_UPDATE_GOLDEN=1"
    want = json.loads(path.read_text())
    assert shape == want, f"the event log differs from {path.name}"
