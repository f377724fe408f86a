"""EPHEMERAL_RUNSC_PATH: the gvisor level runs, probes and reports the configured runsc.

The configured binary is a wrapper that records each invocation, answers ``--version`` with its
own line, and execs the distribution's runsc for everything else: every use must go through it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from ephemeral.sandbox import probe, registry
from ephemeral.sandbox.base import Limits
from ephemeral.settings import Settings

WRAPPER = """#!/bin/sh
echo "$*" >> {log}
if [ "$1" = "--version" ]; then echo "runsc version wrapper-test"; exit 0; fi
exec {runsc} "$@"
"""


@pytest.fixture
def wrapped(tmp_path: Path, rootfs: Path) -> Iterator[tuple[Settings, Path]]:
    runsc = shutil.which("runsc")
    if runsc is None:
        pytest.skip("runsc is not installed (apt-get install runsc)")
    log = tmp_path / "invocations.log"
    wrapper = tmp_path / "runsc-wrapper"
    wrapper.write_text(WRAPPER.format(log=log, runsc=runsc))
    wrapper.chmod(0o755)
    state = Path(tempfile.mkdtemp(prefix="ephemeral-runsc-path-"))
    settings = Settings.load(state_dir=state, runsc_path=wrapper, use_prefect=False)
    yield settings, log
    shutil.rmtree(state, ignore_errors=True)


async def test_the_configured_runsc_is_probed_run_and_reported(
    wrapped: tuple[Settings, Path],
) -> None:
    settings, log = wrapped
    assert await registry.probe_level("gvisor", settings, fresh=True) is None
    driver = registry.get_driver("gvisor", settings)
    sbx = await driver.create(owner="test", limits=Limits())
    try:
        assert sbx.runtime == "runsc version wrapper-test"
        res = await sbx.exec(["echo", "inside"])
        assert (res.exit_code, res.stdout) == (0, "inside\n")
    finally:
        await sbx.destroy()
    calls = log.read_text().splitlines()
    assert "--version" in calls
    assert sum(" run --bundle=" in c for c in calls) >= 2, calls  # the probe's and ours
    path = probe.runtime_path("gvisor", settings)
    assert probe.runtime_version("gvisor", path) == "runsc version wrapper-test"


async def test_a_missing_configured_runsc_makes_gvisor_unavailable(tmp_path: Path) -> None:
    settings = Settings.load(
        state_dir=tmp_path, runsc_path=tmp_path / "no-such-runsc", use_prefect=False
    )
    reason = await registry.get_driver("gvisor", settings).probe()
    assert reason is not None and "EPHEMERAL_RUNSC_PATH" in reason


def test_a_relative_runsc_path_is_refused() -> None:
    with pytest.raises(ValidationError, match="absolute"):
        Settings.load(runsc_path=Path("bin/runsc"))
