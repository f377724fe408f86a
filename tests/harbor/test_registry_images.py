"""Harbor runs a Terminal-Bench-shaped corpus the way Harbor with Docker does (issue 36, item
8): a task's ``docker_image`` is pulled from its registry (the loopback one, TLS and a password)
and its sandbox is made from that image's layers (its WORKDIR the commands' directory); oracle
scores 1.0 and nop 0.0. An image that cannot be pulled and a Dockerfile that does not build are
Harbor's environment errors (``SandboxBuildFailedError``: retried, never graded), not a 0; the
failed build ran once, the other trial got its remembered error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harbor import registry_tasks as rt
from tests.harbor import tasks
from tests.harbor.tasks import trials
from tests.oci.conftest import Registry

pytestmark = pytest.mark.sandbox


def test_a_corpus_of_registry_images(tmp_path: Path, registry: Registry, isolation: str) -> None:
    why = tasks.harbor_missing()
    if why is not None:
        pytest.skip(why)
    base = rt.Pushed(registry, rt.base_layers())
    tag = rt.unique()
    root = tmp_path / "tasks"
    for name in ("serve-seed", "serve-other"):  # two images sharing the base's layers
        ref = base.push(tmp_path, f"tb/{name}:{tag}", {"app/seed.txt": f"{name} {tag}\n"})
        rt.pulled_task(root, name, ref)
    rt.pulled_task(root, "unpullable", f"{registry.host}/tb/absent:{tag}")
    rt.dockerfile_task(root, "unbuildable", f"FROM debian:bookworm\nRUN echo {tag}; false\n")
    state, jobs = tmp_path / "state", tmp_path / "jobs"
    done = tasks.run_job(
        sorted(root.iterdir()), jobs, state, agents=["oracle", "nop"],
        ek={"isolation": isolation}, n=4, timeout=1800, env=rt.env_for(registry, state),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = {(t.task, t.agent): t for t in trials(jobs)}

    for name in ("serve-seed", "serve-other"):
        oracle, nop = found[name, "oracle"], found[name, "nop"]
        assert (oracle.reward, oracle.exception) == (1.0, None), oracle.message
        assert (nop.reward, nop.exception) == (0.0, None), nop.message

    for agent in ("oracle", "nop"):
        lost = found["unpullable", agent]
        assert (lost.reward, lost.exception) == (None, "SandboxBuildFailedError"), lost.message
        assert f"{registry.host}/tb/absent" in lost.message
    broken = [found["unbuildable", agent] for agent in ("oracle", "nop")]
    for trial in broken:
        assert (trial.reward, trial.exception) == (None, "SandboxBuildFailedError"), trial.message
        assert "RUN at line 2 failed" in trial.message
    assert sum("not tried again until asked" in t.message for t in broken) == 1
