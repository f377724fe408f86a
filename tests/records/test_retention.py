"""Retention purge: content past the cutoff goes, billing figures stay."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from ephemeral.errors import InvalidRequest
from ephemeral.records import Records, write_run
from tests.records.helpers import NOW, REMOVED_CHECKS, make_run

BILLING = (
    "SELECT run_id, status, model, reserved_micros, charged_micros, refunded_micros, "
    "model_micros, web_micros, compute_micros, input_tokens, output_tokens, model_calls, "
    "duration_ms FROM runs ORDER BY run_id"
)


def test_purge_removes_old_content_and_keeps_billing(tmp_path: Path) -> None:
    old_canary, new_canary = (f"CANARY{secrets.token_hex(8)}" for _ in range(2))
    old = [make_run(days_ago=d, content=old_canary, steps=3) for d in (31, 35, 60)]
    new = [make_run(days_ago=d, content=new_canary, steps=3) for d in (0, 29)]
    for run in old + new:
        write_run(tmp_path, *run)
    records = Records(tmp_path)
    billing = records.query(BILLING)[1]
    costs_sql = "SELECT run_id, seq, cost_micros, exit_code FROM steps ORDER BY 1, 2"
    step_costs = records.query(costs_sql)

    purged = records.purge_content(retention_days=30, now=NOW)
    # per old run: the run row, three steps, and the two events carrying content
    assert purged == 3 * (1 + 3 + 2)
    assert records.query(BILLING)[1] == billing
    assert records.query(costs_sql) == step_costs

    for path in tmp_path.rglob("*.parquet"):
        assert old_canary.encode() not in path.read_bytes(), path
    _, rows = records.query(
        "SELECT prompt, output, checks FROM runs WHERE created_at < TIMESTAMPTZ '2026-10-30'"
    )
    assert rows == [(None, None, REMOVED_CHECKS)] * 3
    _, rows = records.query(
        "SELECT count(*) FROM steps WHERE command IS NOT NULL OR stdout IS NOT NULL "
        "OR stderr IS NOT NULL"
    )
    assert rows == [(2 * 3,)]  # only the two recent runs keep their step content
    _, rows = records.query("SELECT data FROM events WHERE type = 'web.requested' ORDER BY \"at\"")
    first = json.loads(rows[0][0])
    assert "url" not in first and first["url_bytes"] > 0 and first["cost_micros"] == 30
    assert new_canary in rows[-1][0]

    # a second pass finds nothing more to do
    assert records.purge_content(retention_days=30, now=NOW) == 0


def test_purge_reaches_runs_still_in_fresh_files(tmp_path: Path) -> None:
    canary = f"CANARY{secrets.token_hex(8)}"
    write_run(tmp_path, *make_run(days_ago=45, content=canary))
    assert not list(tmp_path.rglob("compacted.parquet"))
    assert Records(tmp_path).purge_content(30, now=NOW) > 0
    assert all(canary.encode() not in p.read_bytes() for p in tmp_path.rglob("*.parquet"))


def test_purge_validates_retention(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest) as err:
        Records(tmp_path).purge_content(retention_days=-1)
    assert err.value.errors == [{"field": "retention_days", "message": "must be 0 or more"}]
    assert Records(tmp_path).purge_content(retention_days=0, now=NOW) == 0


def test_purge_and_zdr_keep_verify_exit_codes_but_not_their_output(tmp_path: Path) -> None:
    canary = f"CANARY{secrets.token_hex(8)}"
    verify = json.dumps(
        [
            {
                "command": f"echo {canary}",
                "exit_code": 0,
                "stdout": canary,
                "stderr": "",
                "duration_ms": 5,
                "timed_out": False,
            }
        ]
    )
    old, steps, events = make_run(days_ago=45, content=canary)
    write_run(tmp_path, old.model_copy(update={"verify": verify}), steps, events)
    zdr, steps, events = make_run(days_ago=0, content=canary)
    zdr = zdr.model_copy(update={"verify": verify, "zero_data_retention": True})
    write_run(tmp_path, zdr, steps, events)
    records = Records(tmp_path)
    assert records.purge_content(30, now=NOW) > 0
    assert all(canary.encode() not in p.read_bytes() for p in tmp_path.rglob("*.parquet"))
    _, rows = records.query("SELECT verify FROM runs")
    assert [json.loads(v) for (v,) in rows] == [
        [{"duration_ms": 5, "exit_code": 0, "timed_out": False}]
    ] * 2
