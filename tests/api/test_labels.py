"""Labels for cost attribution (issue 37): bounded string maps on runs and sandbox sessions,
kept in the records, and spend grouped by several dimensions at once (API, CLI, HTML report)."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from ephemeral.cli import app as cli_app
from ephemeral.engine.runtime import Runtime
from ephemeral.records import Records
from ephemeral.records.report import render_costs_html
from ephemeral.settings import Settings
from tests.api.conftest import SAMPLE_BODY, Member

pytestmark = pytest.mark.sandbox


async def _run(http: httpx.AsyncClient, member: Member, runtime: Runtime, **labels: str) -> dict:
    r = await http.post("/v1/runs", json={**SAMPLE_BODY, "labels": labels}, headers=member.headers)
    assert r.status_code == 201, r.text
    await runtime.wait(r.json()["id"], 60)
    return r.json()


async def test_labels_on_runs_and_sessions_group_spend(
    http: httpx.AsyncClient, member: Member, runtime: Runtime, api_settings: Settings
) -> None:
    infra = await _run(http, member, runtime, team="infra", ticket="T-1")
    assert infra["labels"] == {"team": "infra", "ticket": "T-1"}
    await _run(http, member, runtime, team="search")
    await _run(http, member, runtime)  # no team: "(none)"
    got = await http.get(f"/v1/runs/{infra['id']}", headers=member.headers)
    assert got.json()["labels"] == {"team": "infra", "ticket": "T-1"}

    r = await http.post(
        "/v1/sandboxes",
        json={"timeout_seconds": 60, "labels": {"team": "infra"}},
        headers=member.headers,
    )
    assert r.status_code == 201, r.text
    session = r.json()
    assert session["labels"] == {"team": "infra"}
    closed = await http.delete(f"/v1/sandboxes/{session['id']}", headers=member.headers)
    assert closed.status_code == 200, closed.text
    await runtime.wait(session["id"], 60)

    # Two dimensions at once, over the API: a column each, named as asked.
    page = await http.get(
        "/v1/costs", params={"by": "kind,label:team", "since": "all"}, headers=member.headers
    )
    assert page.status_code == 200, page.text
    runs = {(row["kind"], row["label:team"]): row["runs"] for row in page.json()["rows"]}
    assert runs == {
        ("run", "infra"): 1,
        ("run", "search"): 1,
        ("run", "(none)"): 1,
        ("session", "infra"): 1,
    }

    # The records keep the labels as JSON; one SQL line answers "spend by team".
    records = Records(api_settings.records_dir)
    try:
        _, rows = records.query(
            "SELECT labels->>'ticket' FROM runs WHERE labels->>'team' = 'infra' AND kind = 'run'"
        )
        assert rows == [("T-1",)]
        # A list of dimensions (repeated --by) is the same as one comma-separated string.
        assert records.costs(["model", "label:team"], None) == records.costs(
            "model,label:team", None
        )
        html = render_costs_html(records, None, by="kind,label:team")
    finally:
        records.close()
    assert '<table id="by-grouped">' in html
    assert "<th>kind</th><th>label:team</th>" in html and "<td>infra</td>" in html

    # The CLI: `--by model --by label:team` groups by both, never only the last.
    result = CliRunner().invoke(
        cli_app,
        ["costs", "--by", "kind", "--by", "label:team", "--since", "all", "--format", "json"],
        env={"EPHEMERAL_STATE_DIR": str(api_settings.state_dir), "EPHEMERAL_URL": ""},
    )
    assert result.exit_code == 0, result.output
    cli_rows = json.loads(result.output)
    assert {(r["kind"], r["label:team"]) for r in cli_rows} == set(runs)


@pytest.mark.parametrize(
    ("labels", "field"),
    [
        ({"bad key!": "x"}, "labels.bad key!.[key]"),
        ({"team": "x" * 257}, "labels.team"),
        ({"team": "a\nb"}, "labels.team"),
        ({"team": 7}, "labels.team"),
        ({f"k{i}": "v" for i in range(33)}, "labels"),
        ({"recipe": "someone-else"}, "labels"),
        ({"suite_run_id": "suite_x"}, "labels"),
        ("team=infra", "labels"),
    ],
)
async def test_bad_labels_are_a_422_naming_the_field(
    http: httpx.AsyncClient, member: Member, labels: object, field: str
) -> None:
    for path, body in (
        ("/v1/runs", SAMPLE_BODY),
        ("/v1/sandboxes", {"timeout_seconds": 60}),
    ):
        r = await http.post(path, json={**body, "labels": labels}, headers=member.headers)
        assert r.status_code == 422, (path, r.text)
        assert [e["field"] for e in r.json()["errors"]] == [field], r.text


def test_costs_by_refuses_unknown_or_repeated_dimensions(api_settings: Settings) -> None:
    env = {"EPHEMERAL_STATE_DIR": str(api_settings.state_dir), "EPHEMERAL_URL": ""}
    for by in (["colour"], ["model", "model"], ["label:bad key"], ["model,"]):
        args = [a for b in by for a in ("--by", b)]
        result = CliRunner().invoke(cli_app, ["costs", *args], env=env)
        assert result.exit_code == 2, (by, result.output)
        assert "by" in result.output, result.output
