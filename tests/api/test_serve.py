"""``ephemeral serve`` as a user starts it: a real process, configured by the environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.patience import PATIENCE

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _serve(tmp_path: Path, env: dict[str, str], *args: str) -> Iterator[subprocess.Popen[bytes]]:
    full = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "EPHEMERAL_STATE_DIR": str(tmp_path / "state"),
        "EPHEMERAL_EXECUTOR": "plain",
        **env,
    }
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ephemeral.cli", "serve", "--pool", "0", *args],
        env=full,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _reach(proc: subprocess.Popen[bytes], port: int, log: Path) -> httpx.Response:
    deadline = time.monotonic() + PATIENCE  # serve's start took minutes at load 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"serve exited {proc.returncode}: {log.read_text()}"
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError(f"serve never answered on port {port}: {log.read_text()}")


def test_serve_listens_on_ephemeral_host_and_port(tmp_path: Path) -> None:
    port = _free_port()
    env = {"EPHEMERAL_HOST": "127.0.0.1", "EPHEMERAL_PORT": str(port)}
    with _serve(tmp_path, env) as proc:
        r = _reach(proc, port, tmp_path / "serve.log")
        assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_a_port_flag_overrides_ephemeral_port(tmp_path: Path) -> None:
    port = _free_port()
    with _serve(tmp_path, {"EPHEMERAL_PORT": "1"}, "--port", str(port)) as proc:
        assert _reach(proc, port, tmp_path / "serve.log").status_code == 200
