"""The ``ephemeral`` Inspect provider: registration, configuration, error mapping."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai", reason="the inspect extra is not installed")

from inspect_ai.util._sandbox.registry import registry_find_sandboxenv

from ephemeral import errors
from ephemeral.inspect_provider import EphemeralSandboxConfig, EphemeralSandboxEnvironment
from ephemeral.inspect_provider.config import load_config
from ephemeral.inspect_provider.provider import _file_error
from tests.egress.conftest import Names, Upstream, names, upstream

__all__ = ["names", "upstream"]  # the egress tests' fixtures, reused

REPO = Path(__file__).resolve().parents[2]


def test_the_entry_point_registers_the_provider() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    target = project["project"]["entry-points"]["inspect_ai"]["ephemeral"]
    importlib.import_module(target)
    assert registry_find_sandboxenv("ephemeral") is EphemeralSandboxEnvironment
    assert "inspect-ai" in " ".join(project["project"]["optional-dependencies"]["inspect"])


def test_config_from_yaml_object_and_dict(tmp_path: Path) -> None:
    path = tmp_path / "ephemeral.yaml"
    path.write_text("isolation: namespaces\ntimeout_seconds: 60\nmax_cost_micros: 5000\n")
    cfg = load_config(str(path))
    assert (cfg.isolation, cfg.timeout_seconds, cfg.max_cost_micros) == ("namespaces", 60, 5000)
    assert load_config({"isolation": "gvisor"}).isolation == "gvisor"
    assert load_config(None) == EphemeralSandboxConfig()
    assert (
        EphemeralSandboxEnvironment.config_deserialize({"web": False}) == EphemeralSandboxConfig()
    )
    req = cfg.session_request()
    assert (req.isolation, req.timeout_seconds, req.max_cost_micros) == ("namespaces", 60, 5000)


def test_bad_config_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("timeout_seconds: '30'\n")
    with pytest.raises(errors.InvalidRequest) as info:
        load_config(str(path))
    assert info.value.errors == [
        {"field": "timeout_seconds", "message": f"{path}: Input should be a valid integer"}
    ]
    with pytest.raises(errors.InvalidRequest) as info:
        load_config({"isolaton": "gvisor"})
    assert info.value.errors is not None and info.value.errors[0]["field"] == "isolaton"


def test_file_errors_map_to_what_inspect_expects() -> None:
    missing = _file_error(errors.FileNotFound("x: ENOENT"), "data/x.txt")
    assert isinstance(missing, FileNotFoundError) and "data/x.txt" in str(missing)
    denied = _file_error(errors.FilePermissionDenied("EACCES"), "f")
    assert isinstance(denied, PermissionError) and "'f'" in str(denied)
    directory = _file_error(errors.IsADirectory("/etc: is a directory"), "/etc")
    assert isinstance(directory, IsADirectoryError) and "directory" in str(directory)


def test_web_in_the_config_passes_to_the_session() -> None:
    assert EphemeralSandboxConfig(web=True).session_request().web is True
    allow = load_config({"web": {"allow": ["site.test"]}}).session_request()
    assert allow.web_allow == ["site.test"]
    with pytest.raises(errors.InvalidRequest) as info:
        load_config({"web": {"allow": ["not a host"]}}).session_request()
    assert info.value.errors is not None and info.value.errors[0]["field"].startswith("web")


@pytest.mark.sandbox
async def test_an_inspect_sandbox_with_web_reaches_a_local_site(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    upstream: Upstream,
    names: Names,
    isolation: str,
) -> None:
    names.set("site.test", "127.0.0.1")
    monkeypatch.setenv("EPHEMERAL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("EPHEMERAL_BROKER_ALLOW_PRIVATE_HOSTS", "1")  # the site is on 127.0.0.1
    monkeypatch.delenv("EPHEMERAL_URL", raising=False)
    task = "web-on"
    for web, expect in ((True, "hello from upstream"), (False, "")):
        config = EphemeralSandboxConfig(isolation=isolation, web=web, pool_size=0)
        await EphemeralSandboxEnvironment.task_init(task, config)
        envs = await EphemeralSandboxEnvironment.sample_init(task, config, {})
        try:
            res = await envs["default"].exec(
                ["curl", "-sS", "-m", "10", f"http://site.test:{upstream.port}/text"]
            )
        finally:
            await EphemeralSandboxEnvironment.sample_cleanup(task, config, envs, False)
            await EphemeralSandboxEnvironment.task_cleanup(task, config, True)
        assert (res.success, res.stdout) == (web, expect), res.stderr
    assert [s.path for s in upstream.seen] == ["/text"]
