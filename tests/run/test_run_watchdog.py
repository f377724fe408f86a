"""The run watchdog (``Runtime.sweep``) past a run's time limit, on a fake clock: a real run in a
real sandbox, its agent busy in a ``sleep 1000``, ends by the watchdog's own exit
(``timed_out``), not as a client's cancel."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ephemeral.engine.runtime import WATCHDOG_GRACE_SECONDS, WATCHDOG_SECONDS
from ephemeral.policy import RunRequest
from ephemeral.records import Records
from ephemeral.runview import fold_events, run_object
from ephemeral.sandbox.registry import probe_level
from ephemeral.settings import Settings
from ephemeral.testing.clock import FakeClock
from tests import runlevel
from tests.drivers import unavailable
from tests.patience import PATIENCE
from tests.run.conftest import turn

pytestmark = [pytest.mark.sandbox]

WATCHDOG_DETAIL = "the run outlived its time limit (stopped by the watchdog)"


async def test_the_watchdog_ends_a_run_past_its_time_limit_timed_out(
    run_settings: Settings, make_cassette: Callable[..., str]
) -> None:
    level = "namespaces"
    why = await probe_level(level, run_settings)
    if why is not None:
        unavailable(f"{level}: {why}", level)
    model = make_cassette("stuck", [turn("sleep 1000"), turn(final="never")])
    # Only the watchdog reads the fake clock: the run's own deadline (60 s) stays real and far.
    clock = FakeClock()
    async with runlevel.started(run_settings, check=True, clock=clock) as runtime:
        org = await runtime.local_org()
        request = RunRequest(prompt="x", model=model, timeout_seconds=60, isolation=level)
        row, _ = await runtime.admit(org, request)
        runtime.launch(row.id)
        async for ev in runtime.events(row.id, follow=True):
            if ev.type == "model.called":  # its `sleep 1000` comes next
                break
        # The watchdog sleeps its first WATCHDOG_SECONDS on the fake clock: one move wakes it
        # past the run's limit and grace (a second move could come before it sleeps again).
        clock.advance(60 + WATCHDOG_GRACE_SECONDS + WATCHDOG_SECONDS)
        done = await runtime.wait(row.id, timeout=PATIENCE)

        assert (done.status, done.termination_reason) == ("timed_out", "timeout")
        assert done.termination_detail == WATCHDOG_DETAIL
        assert done.charged_micros + done.refunded_micros == done.reserved_micros
        events = await runtime.store.events.list(row.id)
        types = [e.type for e in events]
        assert "run.timed_out" in types and "run.cancelled" not in types
        assert "sandbox.destroyed" in types and types[-1] == "run.settled"
        assert fold_events(events)["status"] == "timed_out"
        shown = run_object(done)
        assert shown["status"] == "timed_out"
        assert shown["termination"] == {"reason": "timeout", "detail": WATCHDOG_DETAIL}
    _, rows = Records(run_settings.records_dir).query(
        f"select status, termination_reason from runs where run_id = '{row.id}'"
    )
    assert rows == [("timed_out", "timeout")]
