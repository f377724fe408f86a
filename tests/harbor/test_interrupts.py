"""Harbor's refusals and interruptions: a task asking for the internet with web off is refused
before any trial; Ctrl-C or kill -9 of ``harbor run`` leaves no sandbox (docs/integrations.md).
A file of its own, so that ``make test`` runs it beside test_harbor.py (one file per worker)."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from ephemeral.settings import Settings
from tests import runlevel
from tests.harbor import tasks
from tests.harbor.tasks import run_harbor, trials

pytestmark = pytest.mark.sandbox


@pytest.fixture(autouse=True)
def _harbor() -> None:
    why = tasks.harbor_missing()
    if why is not None:
        pytest.skip(why)


def test_a_task_asking_for_the_internet_is_refused_when_web_is_off(tmp_path: Path) -> None:
    tasks.public(tmp_path / "tasks")
    done = run_harbor(
        tmp_path / "tasks", tmp_path / "jobs", tmp_path / "state",
        agents=["oracle"], ek={"isolation": "namespaces"}, n=1, timeout=300,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode != 0, said[-3000:]
    assert "network_mode='public'" in said and "--ek web=true" in said, said[-3000:]
    assert trials(tmp_path / "jobs") == []


def _open_sessions(state: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(state / "ephemeral.db") as db:
        return db.execute("SELECT id, status FROM runs WHERE settled_at IS NULL").fetchall()


def _solve_running(state: Path) -> bool:
    db_path = state / "ephemeral.db"
    if not db_path.is_file():
        return False
    try:
        with sqlite3.connect(db_path, timeout=5) as db:
            rows = db.execute(
                "SELECT count(*) FROM run_events WHERE type = 'sandbox.exec' "
                "AND data LIKE '%/solution/solve.sh%oracle.txt%'"
            ).fetchone()
    except sqlite3.OperationalError:  # not migrated yet
        return False
    return bool(rows and rows[0])


async def _recover(state: Path) -> None:
    # the start's recovery settles and reaps; the check: it left nothing (and recorded the run)
    async with runlevel.started(Settings.load(state_dir=state), recover=True, watchdog=False):
        pass


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_an_interrupted_or_killed_harbor_leaves_no_sandbox(tmp_path: Path, sig: int) -> None:
    """Ctrl-C (SIGINT to Harbor's process group) mid-agent: Harbor stops the trial and the
    sandbox is destroyed and settled. kill -9: the next runtime start reaps and settles it."""
    tasks.sleeper(tmp_path / "tasks")
    state, jobs = tmp_path / "state", tmp_path / "jobs"
    argv = tasks.harbor_argv(
        tmp_path / "tasks", jobs, agents=["oracle"], ek={"isolation": "namespaces"}, n=1, job="j"
    )
    proc = subprocess.Popen(
        argv, env=tasks.harbor_env(state), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not _solve_running(state):
            assert proc.poll() is None, "harbor ended before the agent phase"
            assert time.monotonic() < deadline, "the agent phase never began"
            time.sleep(0.2)
        assert list((state / "sandboxes").glob("*.json")), "no sandbox while solve.sh runs"
        os.killpg(proc.pid, sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if sig == signal.SIGKILL:
        assert _open_sessions(state), "a killed harbor cannot have settled its session"
        asyncio.run(_recover(state))
    assert _open_sessions(state) == []
    assert list((state / "sandboxes").glob("*.json")) == []
