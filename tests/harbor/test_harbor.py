"""Harbor 0.25 runs its tasks in our sandboxes: ``harbor run -e
ephemeral.harbor:EphemeralEnvironment`` from the Python 3.12 venv, real sandboxes, offline
(docs/integrations.md).

Harbor's ``oracle`` agent (runs the task's solution) scores 1.0 and ``nop`` (does nothing) 0.0
on each task; ``harbor run`` exits 0 even when trials fail, so every trial's result.json is read.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import costs
from tests.harbor import tasks
from tests.harbor.tasks import Trial, trials

pytestmark = pytest.mark.sandbox

GRADED = (tasks.toolbox, tasks.fixbug, tasks.hidden)


@pytest.fixture(autouse=True)
def _harbor() -> None:
    why = tasks.harbor_missing()
    if why is not None:
        pytest.skip(why)


def _by_task(found: list[Trial]) -> dict[tuple[str, str], Trial]:
    return {(t.task, t.agent): t for t in found}


def _sessions(state: Path) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPHEMERAL_URL")}
    env["EPHEMERAL_STATE_DIR"] = str(state)
    rows = costs.by_kind(env)
    assert rows["session"]["compute_micros"] > 0
    return int(rows["session"]["runs"])


def test_oracle_scores_one_and_nop_zero(tmp_path: Path, isolation: str) -> None:
    root = tmp_path / "tasks"
    for write in (*GRADED, tasks.timeout, tasks.unsupported):
        write(root)
    state, jobs = tmp_path / "state", tmp_path / "jobs"
    done = tasks.run_job(
        sorted(root.iterdir()), jobs, state, agents=["oracle", "nop"],
        # retry_failed: a build that failed in an earlier run (the cache is shared) runs again
        ek={"isolation": isolation, "retry_failed": True}, n=4,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = _by_task(trials(jobs))

    for write in GRADED:
        oracle, nop = found[write.__name__, "oracle"], found[write.__name__, "nop"]
        assert (oracle.reward, oracle.exception) == (1.0, None), oracle.message
        assert (nop.reward, nop.exception) == (0.0, None), nop.message

    # The agent phase timed out: Harbor cancelled the exec running solve.sh, and the verifier
    # (same sandbox, right after) found none of its processes left.
    late = found["timeout", "oracle"]
    assert late.exception == "AgentTimeoutError" and late.reward == 1.0, late.message

    # A Dockerfile instruction we do not honour: an infrastructure failure naming the line.
    for agent in ("oracle", "nop"):
        bad = found["unsupported", agent]
        assert bad.exception == "SandboxBuildFailedError", bad.message
        assert "Dockerfile:3: HEALTHCHECK" in bad.message and bad.reward is None

    # Each trial that got a sandbox was a session, settled and recorded; none is left.
    assert _sessions(state) == 2 * (len(GRADED) + 1)
    assert list((state / "sandboxes").glob("*.json")) == []


def test_nothing_of_the_agent_phase_outlives_it_to_forge_the_reward(
    tmp_path: Path, isolation: str
) -> None:
    """Issue 35, finding 6: writers the agent phase left (setsid, double-forked, under a live
    parent; root's, ignoring SIGTERM) are gone before the verifier starts, after the agent's
    normal exit and after its timeout: the verifier's 0 stays 0."""
    root = tmp_path / "tasks"
    tasks.forgers(root)
    state, jobs = tmp_path / "state", tmp_path / "jobs"
    done = tasks.run_job(
        sorted(root.iterdir()), jobs, state, agents=["oracle"], ek={"isolation": isolation}, n=2
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = _by_task(trials(jobs))
    for task, exception in (("forger", None), ("forger_late", "AgentTimeoutError")):
        trial = found[task, "oracle"]
        seen = next((jobs / "job").glob(f"{task}__*/verifier/test-stdout.txt"), None)
        said = seen.read_text() if seen is not None else "(no test-stdout.txt)"
        assert (trial.reward, trial.exception) == (0.0, exception), f"{trial.message}\n{said}"
        assert "forger" not in said, said  # the verifier's ps saw none of them
