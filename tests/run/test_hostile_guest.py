"""A whole run against a guest agent that reports absurd numbers still leaves true records.

The agent is ``tests/sandbox/hostile_agent.py`` behind the real host side (ProcessSandbox and
GuestClient): its first exec reply claims exit 511 after a week, its second 2^63 ms, the reply
that once failed the records writer and cost the run its Parquet files.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ephemeral.engine.runtime import Runtime
from ephemeral.policy import RunRequest
from ephemeral.records import Records
from ephemeral.sandbox import source
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.settings import Settings
from tests.run.conftest import turn
from tests.sandbox.hostile import start_hostile


class HostileDriver:
    isolation = "fake"

    def __init__(self, settings: Settings, mode: str) -> None:
        self.settings = settings
        self.mode = mode

    async def probe(self) -> str | None:
        return None

    async def create(self, *, owner: str, limits: Limits) -> Sandbox:
        return await start_hostile(self.settings, self.mode, owner=owner, limits=limits)


async def test_absurd_guest_numbers_never_cost_the_records(
    runtime: Runtime,
    run_settings: Settings,
    make_cassette: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = HostileDriver(run_settings, "absurd")
    monkeypatch.setattr(source, "get_driver", lambda isolation, settings: driver)

    async def resolve(requested: str, settings: Settings) -> str:
        return "fake"

    monkeypatch.setattr(source, "resolve_isolation", resolve)
    model = make_cassette("absurd", [turn("echo one"), turn("echo two"), turn(final="done")])
    org = await runtime.local_org()
    row, _ = await runtime.admit(org, RunRequest(prompt="p", model=model))
    row = await runtime.execute(row.id)
    events = await runtime.store.events.list(row.id)

    ready = next(e for e in events if e.type == "sandbox.ready")
    assert ready.data["runtime"] == "hostile_agent.py"  # the runtime's own label, recorded
    # the first reply's week is replaced by what the host timed; the 2^63 reply is a lie
    shell = [e.data for e in events if e.type == "shell.executed"]
    assert shell[0]["exit_code"] == 511
    assert 0 <= shell[0]["duration_ms"] < 60_000
    assert row.status == "failed" and row.termination_reason == "sandbox_error", row.status
    assert "duration_ms" in (row.termination_detail or "")

    recs = Records(run_settings.records_dir)
    _, runs = recs.query(f"select status from runs where run_id = '{row.id}'")
    assert runs == [(row.status,)]
    _, steps = recs.query(
        f"select exit_code, duration_ms from steps where run_id = '{row.id}' and kind = 'shell'"
    )
    assert steps and all(0 <= d < 60_000 for _, d in steps)
