"""``ephemeral costs --by kind`` as the end-to-end tests read it: the CLI in a subprocess, on the
state dir its environment names."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def grouped(env: Mapping[str, str], by: str) -> list[dict[str, Any]]:
    """Every row of ``costs --by BY --since all`` (``BY`` may name several dimensions)."""
    costs = subprocess.run(
        [sys.executable, "-m", "ephemeral.cli", "costs", "--by", by, "--since", "all",
         "--format", "json"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert costs.returncode == 0, costs.stderr
    return list(json.loads(costs.stdout))


def by_kind(env: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Every row of ``costs --by kind --since all``, by its kind (``session``, ``run`` ...)."""
    return {r["key"]: r for r in grouped(env, "kind")}
