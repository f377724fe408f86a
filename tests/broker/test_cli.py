"""``ephemeral connections add|list|rm`` through typer's CliRunner on a real state dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ephemeral.cli import app
from tests.broker.conftest import CANARY, state_bytes_contain


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "state"
    monkeypatch.setenv("EPHEMERAL_STATE_DIR", str(d))
    monkeypatch.delenv("EPHEMERAL_DATABASE_URL", raising=False)
    return d


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["connections", *args])
    return result.exit_code, result.output


def test_add_list_rm(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GH_TOKEN_FOR_TEST", f"token {CANARY}")
    code, out = cli(
        "add",
        "github",
        "--base-url",
        "https://api.example.com/",
        "--header-env",
        "Authorization=GH_TOKEN_FOR_TEST",
        "--header",
        "X-GitHub-Api-Version: 2022-11-28",
    )
    assert code == 0, out
    assert "github → https://api.example.com (X-GitHub-Api-Version, Authorization)" in out
    assert CANARY not in out

    code, out = cli("list", "--json")
    assert code == 0, out
    [row] = json.loads(out)
    assert row["name"] == "github" and row["base_url"] == "https://api.example.com"
    assert row["headers"] == ["X-GitHub-Api-Version", "Authorization"]
    code, table = cli("list")
    assert code == 0 and "github" in table and CANARY not in table and "token" not in table

    assert state_bytes_contain(state, CANARY.encode()) == []
    assert state_bytes_contain(state, b"2022-11-28") == []  # every header value is sealed

    code, out = cli("add", "github", "--base-url", "https://x.example", "--header", "A: b")
    assert code == 3 and "already exists" in out  # ERROR (ephemeral/cli/exit_codes.py)
    code, out = cli(
        "add", "github", "--base-url", "https://x.example", "--header", "A: b", "--replace"
    )
    assert code == 0, out

    code, out = cli("rm", "github")
    assert code == 0 and "removed connection github" in out
    code, out = cli("list", "--json")
    assert json.loads(out) == []
    code, out = cli("rm", "github")
    assert code == 3 and "not found" in out


def test_header_env_with_a_whole_header_line(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("API_HEADER_FOR_TEST", f"X-Api-Key: {CANARY}")
    code, out = cli(
        "add", "svc", "--base-url", "http://127.0.0.1:1", "--header-env", "API_HEADER_FOR_TEST"
    )
    assert code == 0, out
    assert "(X-Api-Key)" in out


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["Bad_Name", "--base-url", "https://x.example"], "name"),
        (["ok", "--base-url", "ftp://x.example"], "--base-url"),
        (["ok", "--base-url", "https://u:p@x.example"], "credentials"),
        (["ok", "--base-url", "https://x.example/?a=1"], "query"),
        (["ok", "--base-url", "https://x.example", "--header", "no colon"], "Name: value"),
        (["ok", "--base-url", "https://x.example", "--header", "Host: evil"], "set by the broker"),
        (["ok", "--base-url", "https://x.example", "--header", "A:"], "value"),
        (
            ["ok", "--base-url", "https://x.example", "--header", "A: 1", "--header", "a: 2"],
            "twice",
        ),
        (
            ["ok", "--base-url", "https://x.example", "--header-env", "NOT_SET_ANYWHERE_XYZ"],
            "not set",
        ),
    ],
)
def test_bad_input_names_the_field(state: Path, args: list[str], why: str) -> None:
    code, out = cli("add", *args)
    assert code == 2 and why in out, out


def test_other_org_must_exist(state: Path) -> None:
    code, out = cli("list", "--org", "nobody")
    assert code == 3 and "not found" in out
