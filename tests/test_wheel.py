"""The wheel a user installs finds its image definitions and recipes (bundled as ``_data/``).

Built from this checkout, installed into a fresh virtualenv that sees the dependencies of the
development one (no registry needed past the build backend), and run from outside the checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from ephemeral.sandbox.images import definition_hash
from ephemeral.settings import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("wheel")
    built = _run(
        [sys.executable, "-m", "pip", "wheel", str(REPO_ROOT), "--no-deps", "-w", str(root)],
        root,
        dict(os.environ),
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = root.glob("ephemeral-*.whl")
    venv = root / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        root,
        dict(os.environ),
    ).stdout.strip()
    # The dependencies come from the development environment, after the wheel on the path.
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(wheel)],
        root,
        dict(os.environ),
    )
    assert done.returncode == 0, done.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "EPHEMERAL_"))}
    env["EPHEMERAL_STATE_DIR"] = str(root / "state")
    env["EPHEMERAL_CACHE_DIR"] = os.environ.get(
        "EPHEMERAL_CACHE_DIR", str(Path.home() / ".cache" / "ephemeral")
    )
    return venv, env


def test_an_installed_wheel_finds_its_images_and_recipes(
    installed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    venv, env = installed
    probe = _run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import json, ephemeral; from ephemeral.settings import Settings; s = Settings();"
            "print(json.dumps([ephemeral.__file__, str(s.images_dir), str(s.recipes_dir)]))",
        ],
        tmp_path,
        env,
    )
    assert probe.returncode == 0, probe.stderr
    package, images_dir, recipes_dir = (Path(p) for p in json.loads(probe.stdout))
    assert package.is_relative_to(venv) and not package.is_relative_to(REPO_ROOT)
    assert images_dir.is_relative_to(venv) and recipes_dir.is_relative_to(venv)
    assert (images_dir / "default" / "image.yaml").is_file()
    assert (recipes_dir / "sandbox-proof.yaml").is_file()
    # The same definition as the checkout's, executable bits included: the same cached build.
    assert definition_hash(images_dir / "default") == definition_hash(
        REPO_ROOT / "sandbox_images" / "default"
    )

    cli = str(venv / "bin" / "ephemeral")
    listed = _run([cli, "images", "list"], tmp_path, env)
    assert listed.returncode == 0, listed.stderr
    shown = _run([cli, "recipes", "show", "sandbox-proof"], tmp_path, env)
    assert shown.returncode == 0, shown.stderr
    assert "sandbox-proof" in shown.stdout and "worst case" in shown.stdout
    checked = _run(
        [cli, "recipes", "validate", str(recipes_dir / "sandbox-proof.yaml")], tmp_path, env
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "ok (recipe)" in checked.stdout
    by_name = _run([cli, "recipes", "validate", "sandbox-proof"], tmp_path, env)
    assert by_name.returncode == 0 and "ok (recipe)" in by_name.stdout, by_name.stderr
