"""``ephemeral images login|pull|logout`` against the loopback registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ephemeral.cli import app
from tests.oci import layouts as L
from tests.oci.conftest import PASSWORD, USER, Registry


def test_login_pull_logout(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    digest = registry.push_image(tmp_path, "test/cli:1", [L.tar([L.file("hello", "hi")])])
    for k, v in {
        "EPHEMERAL_STATE_DIR": str(tmp_path / "state"),
        "EPHEMERAL_CACHE_DIR": str(tmp_path / "cache"),
        "EPHEMERAL_REGISTRY_CA_FILE": str(registry.ca_file),
        "EPHEMERAL_REGISTRY_PRIVATE_HOSTS": json.dumps([registry.host]),
    }.items():
        monkeypatch.setenv(k, v)
    runner = CliRunner()
    ref = f"{registry.host}/test/cli:1"
    denied = runner.invoke(app, ["images", "pull", ref])
    assert denied.exit_code == 3 and "wants credentials" in denied.output
    login = runner.invoke(
        app, ["images", "login", registry.host, "-u", USER, "--password-stdin"], input=PASSWORD
    )
    assert login.exit_code == 0, login.output
    stored = (tmp_path / "state" / "registry-credentials.json").read_text()
    assert PASSWORD not in stored and registry.host in stored  # sealed
    pulled = runner.invoke(app, ["images", "pull", ref])
    assert pulled.exit_code == 0, pulled.output
    assert digest in pulled.output and "1 layers" in pulled.output
    listed = runner.invoke(app, ["images", "list"])
    assert f"{ref}  {digest[:19]}" in listed.output and "(pulled)" in listed.output
    bad = runner.invoke(app, ["images", "pull", "Not/Valid:ref"])
    assert bad.exit_code == 2 and "REFERENCE" in bad.output
    gone = runner.invoke(app, ["images", "rm", ref])
    assert gone.exit_code == 0 and "removed" in gone.output
    assert ref not in runner.invoke(app, ["images", "list"]).output
    out = runner.invoke(app, ["images", "logout", registry.host])
    assert (
        out.exit_code == 0
        and registry.host not in (tmp_path / "state" / "registry-credentials.json").read_text()
    )
