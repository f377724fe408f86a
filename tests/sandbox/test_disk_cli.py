"""``ephemeral sandbox exec --disk-mib``: a one-off sandbox with the writable root it asks for,
up to ``EPHEMERAL_DISK_MAX_MIB`` (issue 36, item 7)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from ephemeral.cli import app
from ephemeral.sandbox.base import SandboxDriver
from ephemeral.settings import Settings
from tests.sandbox.leaks import loop_devices

pytestmark = pytest.mark.sandbox


def test_sandbox_exec_takes_a_disk_up_to_the_cap(
    driver: SandboxDriver, sandbox_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    if driver.isolation.startswith("microvm"):
        pytest.skip("a microVM's root is its guest's tmpfs")
    monkeypatch.setenv("EPHEMERAL_STATE_DIR", str(sandbox_settings.state_dir))
    monkeypatch.setenv("EPHEMERAL_DISK_MAX_MIB", "2048")
    runner = CliRunner()
    over = runner.invoke(app, ["sandbox", "exec", "--disk-mib", "4096", "true"])
    assert over.exit_code == 2 and "--disk-mib" in over.output and "2048" in over.output, (
        over.output
    )
    done = runner.invoke(
        app,
        ["sandbox", "exec", "-i", driver.isolation, "--disk-mib", "2048",
         "df -m --output=size / /tmp | tail -n +2"],
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    root, tmp = (int(n) for n in done.output.split())
    assert 1900 < root <= 2048 and tmp == root  # on disk, /tmp with it
    assert loop_devices(str(sandbox_settings.state_dir)) == []  # gone with the sandbox
