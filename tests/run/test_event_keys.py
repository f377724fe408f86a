"""The event contract (docs/design.md §4) against what a real run emits: every event type a run
writes is in the table, and its data carries every key the table lists for that type."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from ephemeral.engine.runtime import Runtime
from ephemeral.policy import RunRequest
from ephemeral.settings import REPO_ROOT
from tests.run.conftest import turn

pytestmark = pytest.mark.sandbox

Spec = list[tuple[str, ...]]  # each entry: one key, or alternatives ("status", "reason")


def documented() -> dict[str, Spec]:
    """Event type -> its required keys, from the table of docs/design.md §4."""
    text = (REPO_ROOT / "docs" / "design.md").read_text()
    section = text.split("## 4.", 1)[1].split("\n## ", 1)[0]
    table: dict[str, Spec] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        types = re.findall(r"`([a-z_.]+)`", cells[0])
        base = types[0].split(".")[0]
        types = [f"{base}{t}" if t.startswith(".") else t for t in types]
        keys: Spec = []
        # Before a ";" the keys of the event itself (after it: another emitter's variant).
        for one, _, other in re.findall(r"`([a-z_]+\??)`( / `([a-z_]+)`)?", cells[1].split(";")[0]):
            if one.endswith("?"):
                continue  # optional
            keys.append((one, other) if other else (one,))
        for t in types:
            table[t] = keys
    return table


def test_the_table_is_read() -> None:
    table = documented()
    assert table["sandbox.ready"] == [
        ("isolation",),
        ("image",),
        ("image_hash",),
        ("boot_ms",),
        ("runtime",),
    ]
    assert table["run.cancelled"] == [("model_calls",), ("tokens",), ("reason",)]
    assert ("status", "reason") in table["connection.requested"]


async def test_a_real_run_emits_the_documented_keys(
    runtime: Runtime, make_cassette: Callable[..., str]
) -> None:
    model = make_cassette("event-keys", [turn("echo hi"), turn("echo again"), turn(final="done")])
    request = RunRequest(
        prompt="p",
        model=model,
        setup=["true"],
        verify=["test -n hi"],
        max_cost_micros=40_000,
    )
    row, _ = await runtime.admit(await runtime.local_org(), request)
    row = await runtime.execute(row.id)
    assert row.status == "succeeded", row.termination_detail
    events = await runtime.store.events.list(row.id)
    table = documented()
    seen = {e.type for e in events}
    assert not seen - set(table), f"undocumented event types: {sorted(seen - set(table))}"
    for expected in ("run.queued", "sandbox.ready", "worker.started", "setup.executed"):
        assert expected in seen
    for expected in ("model.called", "shell.executed", "verify.executed", "sandbox.destroyed"):
        assert expected in seen
    assert {"run.succeeded", "run.output", "run.settled"} <= seen
    for ev in events:
        missing = [
            " / ".join(alts) for alts in table[ev.type] if not any(k in ev.data for k in alts)
        ]
        assert not missing, f"{ev.type} lacks {missing}: {sorted(ev.data)}"
