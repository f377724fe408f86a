"""``ephemeral images prebuild`` on a small Harbor dataset (issue 36, item 8): every environment
resolved first, then pulled (from the loopback registry) or built, the table says cached /
pulled / built / failed; two prebuilds at once make each environment once (a lock file per
environment in the cache dir); a failed build is remembered by its content digest and not tried
again until ``--retry-failed``. Real registry, real builds (in the build sandbox)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ephemeral.recipes import prebuild
from ephemeral.settings import Settings
from tests.harbor import registry_tasks as rt
from tests.oci.conftest import Registry

pytestmark = pytest.mark.sandbox


def _prebuild(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "ephemeral.cli", "images", "prebuild", *args]
    return subprocess.Popen(
        argv, env=rt.cli_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _json(proc: subprocess.Popen[str]) -> dict[str, dict[str, Any]]:
    out, err = proc.communicate(timeout=1800)
    assert proc.returncode == 1, err[-3000:]  # a failure among them: exit 1
    return {Path(row["sources"][0]).name: row for row in json.loads(out)}


def test_prebuild_a_dataset(tmp_path: Path, registry: Registry) -> None:
    base = rt.Pushed(registry, rt.base_layers())
    tag = rt.unique()
    dataset = tmp_path / "dataset"
    reference = base.push(tmp_path, f"tb/hello:{tag}", {"app/seed.txt": tag})
    rt.pulled_task(dataset, "pull", reference)
    rt.pulled_task(dataset, "missing", f"{registry.host}/tb/absent:{tag}")
    rt.ours_task(dataset, "ours")
    rt.dockerfile_task(dataset, "build", f"FROM debian:bookworm\nRUN echo {tag} > /marker\n")
    rt.dockerfile_task(dataset, "broken", f"FROM debian:bookworm\nRUN echo {tag} && false\n")
    env = rt.env_for(registry, tmp_path / "state")

    # two at once: each environment is made once, the other process waits and finds it made
    first = [_prebuild([str(dataset), "--json", "-j", "4"], env) for _ in range(2)]
    a, b = (_json(p) for p in first)
    assert a.keys() == b.keys() == {"pull", "missing", "ours", "build", "broken"}
    pair = {k: sorted([a[k]["status"], b[k]["status"]]) for k in a}
    assert pair["pull"] == ["cached", "pulled"]
    assert pair["build"] == ["built", "cached"]
    assert pair["ours"] == ["cached", "cached"]
    assert pair["missing"] == ["failed", "failed"]
    assert pair["broken"] == ["failed", "failed"]
    # the broken build ran once: the waiter got its remembered error
    assert sorted([a["broken"]["remembered"], b["broken"]["remembered"]]) == [False, True]
    assert "RUN at line 2 failed" in a["broken"]["error"]
    assert "RUN at line 2 failed" in b["broken"]["error"]
    assert "not tried again until asked" in (a["broken"]["error"] + b["broken"]["error"])
    assert not a["missing"]["remembered"] and "tb/absent" in a["missing"]["error"]
    assert a["pull"]["digest"] == b["pull"]["digest"] and a["pull"]["digest"].startswith("sha256:")
    assert a["build"]["image"] == prebuild.image_name(a["build"]["digest"])

    # again, as a person reads it: a table; everything made is cached, the failure remembered
    again = _prebuild([str(dataset)], env)
    out, err = again.communicate(timeout=600)
    assert again.returncode == 1, err
    rows = {
        line.split()[1]: line for line in out.splitlines() if line.startswith(("cached", "failed"))
    }
    assert all(rows[k].startswith("cached") for k in ("default", reference)), out
    assert "3 cached, 0 pulled, 0 built, 2 failed" in out, out
    assert "│ failed (remembered)" in out and "│ cached" in out, out

    # asked: the build is tried again (and fails again: its marker counts two attempts)
    retried = _json(_prebuild([str(dataset), "--json", "--retry-failed"], env))
    assert retried["broken"]["status"] == "failed" and not retried["broken"]["remembered"]
    marker = prebuild.failure(Settings.load(), retried["broken"]["digest"])
    assert marker is not None and marker["attempts"] == 2
    assert {k: retried[k]["status"] for k in ("pull", "build", "ours")} == dict.fromkeys(
        ("pull", "build", "ours"), "cached"
    )


def test_recipes_and_suites_name_their_images(tmp_path: Path) -> None:
    """A suite's recipes and their images (the shipped smoke suite: the default image)."""
    repo = Path(__file__).resolve().parents[2]
    found = prebuild.find(Settings.load(), [repo / "recipes" / "suites" / "smoke.yaml"])
    assert [(o.env.kind, o.env.image, len(o.sources)) for o in found] == [("image", "default", 3)]
    bad = prebuild.find(Settings.load(), [tmp_path])
    assert bad[0].env.kind == "invalid" and "neither a Harbor task" in bad[0].env.error


@pytest.mark.parametrize(
    ("toml", "dockerfile", "force", "want"),
    [
        ('docker_image = "alexgshaw/chess-best-move:20251031"', True, False,
         ("pull", "docker.io/alexgshaw/chess-best-move:20251031")),
        ('docker_image = "ubuntu"', False, False, ("pull", "docker.io/library/ubuntu:latest")),
        ('docker_image = "ubuntu:24.04"', True, True, ("dockerfile", "")),
        ('docker_image = "ubuntu:24.04"', False, True, ("pull", "docker.io/library/ubuntu:24.04")),
        ('docker_image = "debian:bookworm-slim"', False, False, ("image", "default")),
        ("", True, False, ("dockerfile", "")),
        ("", False, False, ("invalid", "not found and the task sets no docker_image")),
        ('docker_image = "Not A Reference"', False, False, ("invalid", "not an image reference")),
        ("docker_image = 3", False, False, ("invalid", "docker_image is not a string")),
        ("docker_image = [", False, False, ("invalid", "task.toml")),
    ],
)  # fmt: skip
def test_a_task_resolves_as_harbor_with_docker_does(
    tmp_path: Path, toml: str, dockerfile: bool, force: bool, want: tuple[str, str]
) -> None:
    """docker_image wins unless --force-build with a Dockerfile; a Debian bookworm name is our
    image; any other is a registry image with Docker's reference rules."""
    (tmp_path / "environment").mkdir()
    (tmp_path / "task.toml").write_text(f"[environment]\n{toml}\n")
    if dockerfile:
        (tmp_path / "environment" / "Dockerfile").write_text("FROM debian:bookworm\n")
    env = prebuild.harbor_task(Settings.load(), tmp_path, force_build=force)
    kind, text = want
    assert env.kind == kind, env
    if kind == "invalid":
        assert text in env.error
    elif kind == "dockerfile":
        assert env.dockerfile == tmp_path / "environment" / "Dockerfile"
    else:
        assert env.image == text


def test_compose_tasks_are_refused(tmp_path: Path) -> None:
    (tmp_path / "environment").mkdir()
    (tmp_path / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    (tmp_path / "task.toml").write_text('[environment]\ndocker_image = "ubuntu:24.04"\n')
    env = prebuild.harbor_task(Settings.load(), tmp_path)
    assert env.kind == "invalid" and "docker-compose tasks" in env.error
