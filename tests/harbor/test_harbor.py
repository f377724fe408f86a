"""Harbor 0.25 runs its tasks in our sandboxes: ``harbor run -e
ephemeral.harbor:EphemeralEnvironment`` from the Python 3.12 venv, real sandboxes, offline
(docs/integrations.md).

Harbor's ``oracle`` agent (runs the task's solution) scores 1.0 and ``nop`` (does nothing) 0.0
on each task; ``harbor run`` exits 0 even when trials fail, so every trial's result.json is read.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ephemeral.service import Runtime
from ephemeral.settings import Settings
from tests.harbor import tasks
from tests.harbor.tasks import REPO, Trial, run_harbor, trials

pytestmark = pytest.mark.sandbox

GRADED = (tasks.toolbox, tasks.fixbug, tasks.hidden)


@pytest.fixture(autouse=True)
def _harbor() -> None:
    why = tasks.harbor_missing()
    if why is not None:
        pytest.skip(why)


def _by_task(found: list[Trial]) -> dict[str, Trial]:
    return {t.task: t for t in found}


def _sessions(state: Path) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPHEMERAL_URL")}
    env["EPHEMERAL_STATE_DIR"] = str(state)
    costs = subprocess.run(
        [sys.executable, "-m", "ephemeral.cli", "costs", "--by", "kind", "--since", "all",
         "--format", "json"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert costs.returncode == 0, costs.stderr
    rows = {r["key"]: r for r in json.loads(costs.stdout)}
    assert rows["session"]["compute_micros"] > 0
    return int(rows["session"]["runs"])


def test_oracle_scores_one_and_nop_zero(tmp_path: Path, isolation: str) -> None:
    graded, extra = tmp_path / "graded", tmp_path / "extra"
    for write in GRADED:
        write(graded)
    tasks.timeout(extra)
    tasks.unsupported(extra)
    state, jobs = tmp_path / "state", tmp_path / "jobs"
    ek = {"isolation": isolation}

    done = run_harbor(graded, jobs, state, agents=["oracle"], ek=ek, job="oracle")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    oracle = _by_task(trials(jobs, "oracle"))
    done = run_harbor(graded, jobs, state, agents=["nop"], ek=ek, job="nop")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    nop = _by_task(trials(jobs, "nop"))
    done = run_harbor(extra, jobs, state, agents=["oracle"], ek=ek, job="extra")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    more = _by_task(trials(jobs, "extra"))

    for write in GRADED:
        name = write.__name__
        assert (oracle[name].reward, oracle[name].exception) == (1.0, None), oracle[name].message
        assert (nop[name].reward, nop[name].exception) == (0.0, None), nop[name].message

    # The agent phase timed out: Harbor cancelled the exec running solve.sh, and the verifier
    # (same sandbox, right after) found none of its processes left.
    late = more["timeout"]
    assert late.exception == "AgentTimeoutError" and late.reward == 1.0, late.message

    # A Dockerfile instruction we do not honour: an infrastructure failure naming the line.
    bad = more["unsupported"]
    assert bad.exception == "SandboxBuildFailedError", bad.message
    assert "Dockerfile:3: HEALTHCHECK" in bad.message and bad.reward is None

    # Each trial that got a sandbox was a session, settled and recorded; none is left.
    assert _sessions(state) == 2 * len(GRADED) + 1
    assert list((state / "sandboxes").glob("*.json")) == []


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
    runtime = await Runtime.start(Settings.load(state_dir=state), recover=True, watchdog=False)
    await runtime.close()


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
