"""A start that talks: while ``ephemeral run`` waits (Prefect, an image, the pool) it says so on
stderr, one line per stage in a pipe, before the timeline, and ``--json`` stdout stays one JSON
document; ``ephemeral serve`` logs its start-up stages and where it is once healthy.

Real processes, real sandboxes, the product page's replay recipe (recipes/sandbox-proof.yaml).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ephemeral.settings import Settings
from tests import drivers
from tests.patience import PATIENCE

pytestmark = [pytest.mark.sandbox, pytest.mark.prefect, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "sandbox-proof.yaml"
CLI = [sys.executable, "-m", "ephemeral.cli"]
# What `ephemeral run` waits for before its first run, in order (ephemeral/cli/progress.py)
STAGES = [
    "ephemeral: starting",
    "ephemeral: loading Prefect (--no-prefect runs without it)",
    "ephemeral: starting Prefect's embedded server",
    "ephemeral: opening the store",
]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    drivers.built_image(Settings.load(state_dir=tmp_path / "state"), "default")
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "EPHEMERAL_STATE_DIR": str(tmp_path / "state"),
        "EPHEMERAL_EXECUTOR": "flow",
        "EPHEMERAL_URL": "",
    }


def _stages(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("ephemeral: ")]


def test_piped_run_names_its_stages_before_the_timeline(env: dict[str, str]) -> None:
    merged = subprocess.run(
        [*CLI, "run", str(RECIPE)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert merged.returncode == 0, merged.stdout
    lines = merged.stdout.splitlines()
    assert _stages(lines) == STAGES
    first_event = next(i for i, line in enumerate(lines) if line.startswith("  1. "))
    assert lines.index(STAGES[-1]) < first_event  # every stage before the timeline

    as_json = subprocess.run(
        [*CLI, "run", str(RECIPE), "--json"], env=env, capture_output=True, text=True, timeout=600
    )
    assert as_json.returncode == 0, as_json.stderr
    assert _stages(as_json.stderr.splitlines()) == STAGES  # on stderr, in order
    run = json.loads(as_json.stdout)  # one clean document: no stage line on stdout
    assert run["status"] == "succeeded"
    assert not _stages(as_json.stdout.splitlines())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_logs_its_stages_and_where_it_is(env: dict[str, str], tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [*CLI, "serve", "--port", str(port), "--pool", "1"],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    ready = f"ready: API {base}/v1 (GET {base}/healthz), runs {base}/runs"
    try:
        deadline = time.monotonic() + PATIENCE  # a cold Prefect server on a loaded 2-core host
        while ready not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        with urllib.request.urlopen(f"{base}/healthz", timeout=30) as resp:
            assert resp.status == 200  # it is healthy when it says so
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text = log.read_text()
    order = [
        "starting Prefect's embedded server",
        "opening the store",
        "booting the warm pool (1 ",
        ready,
    ]
    at = [text.find(s) for s in order]
    assert -1 not in at and at == sorted(at), text
