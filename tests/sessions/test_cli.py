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
from tests.egress.conftest import Upstream, upstream

__all__ = ["upstream"]  # the egress tests' fixture, reused

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


def test_sandboxes_create_with_web_reaches_a_local_site(
    session_settings: Settings, upstream: Upstream, isolation: str
) -> None:
    # The server's loop is not the test's, so the ``*.test`` name table does not answer there:
    # the site is ``localhost`` (allowed with broker_allow_private_hosts), asked for through the
    # proxy with curl's ``--noproxy ''`` (no_proxy lists localhost).
    settings = session_settings.model_copy(update={"broker_allow_private_hosts": True})
    with live_server(settings) as server:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "EPHEMERAL_URL": server.url,
            "EPHEMERAL_API_KEY": server.member("cli"),
        }
        made = _cli(env, "create", "--isolation", isolation, "--allow", "localhost", "--json")
        assert made.returncode == 0, made.stderr
        obj = json.loads(made.stdout)
        assert obj["policy"]["web"] == {"allow": ["localhost"]}
        curl = ["curl", "-sS", "-m", "10", "--noproxy", ""]
        url = f"http://localhost:{upstream.port}/text"
        ran = _cli(env, "exec", obj["id"], "--", *curl, url)
        assert (ran.returncode, ran.stdout) == (0, b"hello from upstream"), ran.stderr
        literal = _cli(
            env, "exec", obj["id"], "--", *curl, "-f", url.replace("localhost", "127.0.0.1")
        )
        assert literal.returncode != 0  # an IP literal never matches an allow list
        ended = json.loads(_cli(env, "end", obj["id"], "--json").stdout)
    assert ended["cost"]["breakdown"]["web_micros"] > 0
    assert [s.path for s in upstream.seen] == ["/text"]
