"""``ephemeral sandboxes …`` against a real server (uvicorn on loopback) and real sandboxes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ephemeral.settings import Settings
from tests.api.server import LiveServer, live_server

pytestmark = pytest.mark.sandbox
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(session_settings: Settings) -> Iterator[LiveServer]:
    with live_server(session_settings) as srv:
        yield srv


def _cli(env: dict[str, str], *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ephemeral.cli", "sandboxes", *args],
        env=env,
        cwd=REPO,
        input=stdin,
        capture_output=True,
        timeout=120,
    )


def test_sandboxes_commands(server: LiveServer, isolation: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "EPHEMERAL_URL": server.url,
        "EPHEMERAL_API_KEY": server.member("cli"),
    }
    made = _cli(env, "create", "--isolation", isolation, "--timeout", "120", "--budget", "0.1")
    assert made.returncode == 0, made.stderr
    sid = made.stdout.decode().strip()
    ran = _cli(env, "exec", sid, "--", "sh", "-c", "cat; echo to-err >&2; exit 3", stdin=b"in\n")
    assert (ran.returncode, ran.stdout, ran.stderr) == (3, b"in\n", b"to-err\n")
    local = tmp_path / "local.txt"
    local.write_bytes(b"payload")
    assert _cli(env, "put", sid, str(local), "sub/file.txt").returncode == 0
    got = _cli(env, "get", sid, "sub/file.txt")
    assert (got.returncode, got.stdout) == (0, b"payload")
    missing = _cli(env, "get", sid, "nope")
    assert missing.returncode == 3 and b"nope: ENOENT: No such file" in missing.stderr
    killed = _cli(env, "exec", sid, "--timeout", "0.5", "--", "sleep", "30")
    assert killed.returncode == 124
    ended = _cli(env, "end", sid, "--json")
    obj = json.loads(ended.stdout)
    assert obj["status"] == "succeeded" and obj["usage"]["execs"] == 2
    assert obj["cost"]["charged_micros"] + obj["cost"]["refunded_micros"] == 100_000


def test_sandboxes_need_a_server() -> None:
    env = {k: v for k, v in os.environ.items() if k != "EPHEMERAL_URL"}
    env["PYTHONPATH"] = str(REPO)
    res = _cli(env, "create")
    assert res.returncode == 2 and b"EPHEMERAL_URL" in res.stderr
