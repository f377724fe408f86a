"""The in-memory fake double and the isolation registry (no sandbox runtime needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.sandbox import registry
from ephemeral.sandbox.base import ExecResult, Limits
from ephemeral.settings import Settings
from ephemeral.testing.sandbox import FakeDriver
from tests.drivers import unavailable


async def test_fake_behaves_like_a_sandbox_for_simple_commands() -> None:
    driver = FakeDriver()
    sbx = await driver.create(owner="run_x", limits=Limits())
    assert sbx.isolation == "fake"
    assert (await sbx.exec("whoami")).stdout == "worker\n"
    assert (await sbx.exec("pwd")).stdout == sbx.workdir + "\n"
    curl = await sbx.exec("curl -sS -m 8 https://example.com")
    assert curl.exit_code == 6 and "Could not resolve host: example.com" in curl.stderr
    made = await sbx.exec("echo proof > /tmp/proof.txt && ls /tmp/proof.txt")
    assert (made.exit_code, made.stdout) == (0, "/tmp/proof.txt\n")
    assert await sbx.get_file("/tmp/proof.txt") == b"proof\n"
    assert (await sbx.exec("exit 3")).exit_code == 3
    assert (await sbx.exec("python3 -c 'print(1)'")).exit_code == 127  # never a host call
    assert (await sbx.exec("sleep 100", timeout=1)).timed_out
    other = await driver.create(owner="run_y", limits=Limits())
    assert (await other.exec("cat /tmp/proof.txt")).exit_code == 1
    await sbx.destroy()
    with pytest.raises(errors.SandboxError):
        await sbx.exec("true")


async def test_fake_scripted_responses_and_output_cap() -> None:
    canned = ExecResult(
        exit_code=0, stdout="x" * 100, stderr="", duration_ms=5, truncated=False, timed_out=False
    )
    driver = FakeDriver(responses={"python3 primes.py": canned})
    sbx = await driver.create(owner="run_x", limits=Limits())
    res = await sbx.exec("python3 primes.py", max_output=10)
    assert res.stdout == "x" * 10 and res.truncated
    assert driver.sandboxes[0].commands == ["python3 primes.py"]


async def test_auto_never_picks_fake_or_tcg(tmp_path: Path) -> None:
    settings = Settings.load(state_dir=tmp_path)
    try:
        picked = await registry.resolve_isolation("auto", settings)
    except errors.IsolationUnavailable as exc:
        unavailable(f"no isolation runs here: {exc.detail}")
    assert picked in ("microvm-kvm", "gvisor", "namespaces")


async def test_unknown_isolation_names_the_field(tmp_path: Path) -> None:
    settings = Settings.load(state_dir=tmp_path)
    with pytest.raises(errors.InvalidRequest) as exc:
        await registry.resolve_isolation("docker", settings)
    assert exc.value.errors is not None
    assert [e["field"] for e in exc.value.errors] == ["isolation"]
    assert "docker" in exc.value.detail


async def test_a_level_is_never_downgraded(tmp_path: Path) -> None:
    """microvm asked on a host without working KVM fails with the reason; never gvisor."""
    settings = Settings.load(state_dir=tmp_path)
    why = await registry.probe_level("microvm-kvm", settings)
    if why is None:
        pytest.skip("this host runs microvm-kvm")
    with pytest.raises(errors.IsolationUnavailable, match="microvm-kvm"):
        await registry.resolve_isolation("microvm", settings)
