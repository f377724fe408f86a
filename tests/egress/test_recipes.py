"""The egress recipes end to end through the CLI (`ephemeral eval`), as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.broker.conftest import CANARY, Upstream, state_bytes_contain
from tests.evals.conftest import REPO, cli, shell_events

pytestmark = [pytest.mark.sandbox]


def test_connection_from_code_recipe(upstream: Upstream, tmp_path: Path) -> None:
    state = tmp_path / "state"
    added = cli(
        state,
        "connections",
        "add",
        "svc",
        "--base-url",
        f"{upstream.base}/api",
        "--header-env",
        "Authorization=SVC_AUTH",
        SVC_AUTH=f"Bearer {CANARY}",
    )
    assert added.returncode == 0, added.stderr
    done = cli(
        state,
        "eval",
        str(REPO / "recipes" / "connection-from-code.yaml"),
        "--no-prefect",
        "--json",
        EPHEMERAL_BROKER_ALLOW_PRIVATE_HOSTS="true",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["passed"] is True, report
    # the GET went out once, with the stored credential; the POST never left the host
    assert [(s.method, s.path) for s in upstream.seen] == [("GET", "/api/repos/acme/app")]
    assert upstream.seen[0].headers["Authorization"] == f"Bearer {CANARY}"
    executed = shell_events(state)
    assert '"Authorization": "[redacted]"' in executed[0]["stdout"]
    assert all(CANARY not in d["stdout"] for d in executed)
    assert state_bytes_contain(state, CANARY.encode()) == []
