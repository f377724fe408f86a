"""The hostile-agent recipe through whole runs: the recorded results are the real ones.

``recipes/hostile-agent.yaml`` replays an agent that writes a script forging its own command's
reply into the guest agent's channel, floods its output and probes the sandbox's walls. On every
level this host runs, the eval must pass all of its checks (exit 42 and ``REAL`` recorded, each
probe refused) and nothing the forger wrote may appear in the stored timeline.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from ephemeral.sandbox import registry
from ephemeral.settings import Settings
from tests.drivers import unavailable
from tests.evals.conftest import REPO, cli, shell_events

pytestmark = [pytest.mark.sandbox]

LEVELS = ["gvisor", "namespaces", pytest.param("microvm-tcg", marks=pytest.mark.slow)]


@pytest.mark.parametrize("level", LEVELS)
def test_hostile_agent_cannot_forge_its_record(level: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    why = asyncio.run(registry.probe_level(level, Settings.load(state_dir=state)))
    if why is not None:
        unavailable(f"{level} cannot run here: {why}", level)
    recipe = yaml.safe_load((REPO / "recipes" / "hostile-agent.yaml").read_text())
    recipe["policy"]["isolation"] = level
    if level.startswith("microvm"):
        recipe["policy"]["timeout_seconds"] = 300  # emulated: every exec is ~10x slower
        # A VM's vsock space is its own (it has no vsock device): a bind there touches no host.
        recipe["checks"] = [c for c in recipe["checks"] if "AF_VSOCK" not in str(c)]
    path = tmp_path / "hostile-agent.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))

    done = cli(state, "eval", str(path), "--no-prefect", "--json", timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["passed"] is True, report

    executed = shell_events(state)
    forge = next(d for d in executed if d["command"].startswith("python3 forge.py"))
    assert forge["exit_code"] == 42 and "REAL" in forge["stdout"]
    assert all("FORGED" not in d["stdout"] for d in executed)
    flood = next(d for d in executed if d["command"].startswith("head -c 30000000"))
    assert flood["truncated"] is True and flood["exit_code"] == 0
