"""A killed test process takes its cluster with it (tests/watchdog.py).

A stand-in for pytest (a Python process running the harnesses as a test does) starts a
PostgreSQL through tests/fixtures_pg.py, a cluster process through tests/cluster/harness.py and
a server process through tests/evals/prefect_server.py (each a process with a child, in a
session of its own, as ``serve``, workers and ``prefect server`` are), and is then killed with
SIGKILL: no finalizer, no ``atexit``. Every one of those processes must end, the postmaster's
children too, and PostgreSQL's directory must go.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_pg import PgCluster

REPO = Path(__file__).resolve().parents[2]
GONE_SECONDS = 60
TREE = "sleep 600 & sleep 600"  # a leader and a child in its group
STAND_IN = f"""
import json, sys, time
from pathlib import Path
from tests.cluster.harness import Cluster
from tests.fixtures_pg import PgCluster

root = Path(sys.argv[1])
(root / "prefect").mkdir(parents=True)
pg = PgCluster().start()
cluster = Cluster(root, pg.url("postgres"))
worker = cluster.spawn("worker", "sh", "-c", {TREE!r})
server = cluster.server.spawn("server", "sh", "-c", {TREE!r})
postmaster = int((pg.dir / "data" / "postmaster.pid").read_text().split()[0])
print(json.dumps({{"pg_dir": str(pg.dir), "postmaster": postmaster,
                  "groups": [worker.pid, server.pid]}}), flush=True)
time.sleep(600)
"""


def _live() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every live process (a zombie is gone)."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2 :].split()
        if fields[0] not in ("Z", "X"):
            found[int(entry)] = (int(fields[1]), int(fields[2]))
    return found


def _ours(groups: list[int], postmaster: int) -> set[int]:
    """The live processes of those groups, the postmaster and its children."""
    return {
        pid
        for pid, (ppid, pgid) in _live().items()
        if pgid in groups or pid == postmaster or ppid == postmaster
    }


def test_a_killed_test_process_leaves_no_cluster_process_or_directory(tmp_path: Path) -> None:
    reason = PgCluster().unavailable()
    if reason:
        pytest.skip(reason)
    stand_in = subprocess.Popen(
        [sys.executable, "-c", STAND_IN, str(tmp_path / "cluster")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started: dict[str, Any] = {}
    try:
        assert stand_in.stdout is not None
        line = stand_in.stdout.readline()
        assert line, stand_in.communicate(timeout=30)[1][-3000:]
        started = json.loads(line)
        groups, postmaster = started["groups"], started["postmaster"]
        # both trees (a shell and its sleeps) and the postmaster with its children are up: the
        # stand-in reports a tree as soon as its leader exists, before the shell forks its sleeps
        deadline = time.monotonic() + 30
        while True:
            live = _live()
            sizes = [len([p for p, (_, g) in live.items() if g == group]) for group in groups]
            if min(sizes) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for group in groups:
            assert len([p for p, (_, g) in live.items() if g == group]) >= 2, live
        assert [p for p, (parent, _) in live.items() if parent == postmaster], postmaster

        stand_in.kill()
        stand_in.wait(30)

        deadline = time.monotonic() + GONE_SECONDS
        while _ours(groups, postmaster) or Path(started["pg_dir"]).exists():
            assert time.monotonic() < deadline, (
                f"left after {GONE_SECONDS} s: {_ours(groups, postmaster)}, "
                f"{started['pg_dir']} exists: {Path(str(started['pg_dir'])).exists()}"
            )
            time.sleep(0.2)
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait()
        if started:  # what a failure left, so that it does not outlive this test
            for pid in _ours(started["groups"], started["postmaster"]):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(started["pg_dir"], ignore_errors=True)
