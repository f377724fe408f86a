"""One log line per run as it ends (``ephemeral serve`` shows ``ephemeral.runs`` in its log):
its id, status, reason and charge."""

from __future__ import annotations

import logging

import pytest

from ephemeral.engine.runtime import Runtime
from ephemeral.money.amounts import usd
from ephemeral.policy import RunRequest
from tests.run.test_agent_run import run_to_end
from tests.sample import SAMPLE_PROMPT

pytestmark = [pytest.mark.sandbox]


async def test_a_closed_run_is_one_log_line(
    runtime: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="ephemeral.runs"):
        row, _ = await run_to_end(
            runtime, RunRequest(prompt=SAMPLE_PROMPT, model="replay/sandbox-proof")
        )
    lines = [r.getMessage() for r in caplog.records if r.name == "ephemeral.runs"]
    assert lines == [f"{row.id} succeeded (completed), charged {usd(row.charged_micros)}"]
