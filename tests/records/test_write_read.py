"""Writing a run's files and reading them back through the views."""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from ephemeral.errors import InvalidRequest
from ephemeral.records import Records, RunRecord, write_run
from ephemeral.records.schema import columns
from tests.records.helpers import NOW, REMOVED_CHECKS, make_run


def _all_bytes(root: Path) -> list[tuple[Path, bytes]]:
    return [(p, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()]


def test_round_trip_every_column(tmp_path: Path) -> None:
    run, steps, events = make_run(steps=3)
    paths = write_run(tmp_path, run, steps, events)
    day = run.created_at.date().isoformat()
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == [
        f"v1/kind={kind}/date={day}/host=h1/{run.run_id}.parquet"
        for kind in ("steps", "events", "runs")
    ]
    records = Records(tmp_path)
    cols, rows = records.query("SELECT * FROM runs")
    assert len(rows) == 1
    got = dict(zip(cols, rows[0], strict=True))
    for name, value in run.model_dump().items():
        assert got[name] == value, name
    assert got["schema_version"] == 1
    assert got["date"] == run.created_at.date()

    cols, rows = records.query("SELECT * FROM steps ORDER BY seq")
    assert [dict(zip(cols, r, strict=True))["kind"] for r in rows] == [s.kind for s in steps]
    for step, row in zip(steps, rows, strict=True):
        got = dict(zip(cols, row, strict=True))
        for name, value in step.model_dump().items():
            assert got[name] == value, name
        assert got["host"] == "h1"

    cols, rows = records.query("SELECT seq, type, data FROM events ORDER BY seq")
    assert rows == [(e.seq, e.type, e.data) for e in events]


def test_step_kind_survives_the_kind_partition(tmp_path: Path) -> None:
    # The directory is kind=steps; a hive reader would otherwise report every step as "steps".
    run, steps, events = make_run(steps=2)
    write_run(tmp_path, run, steps, events)
    _, rows = Records(tmp_path).query("SELECT DISTINCT kind FROM steps ORDER BY 1")
    assert rows == [("model",), ("shell",)]


def test_empty_store_has_typed_views(tmp_path: Path) -> None:
    records = Records(tmp_path / "nothing-yet")
    for kind in ("runs", "steps", "events"):
        cols, rows = records.query(f"SELECT * FROM {kind}")
        assert rows == []
        assert [c for c, _, _ in columns(kind)] == cols[: len(columns(kind))]
    assert records.costs("model", None) == (records.costs("model", None)[0], [])


def test_naive_times_are_utc_and_timestamps_keep_the_instant(tmp_path: Path) -> None:
    naive = datetime(2026, 11, 28, 23, 30)
    run, steps, events = make_run(created_at=naive)
    assert run.created_at == naive.replace(tzinfo=UTC)
    write_run(tmp_path, run, steps, events)
    assert (tmp_path / "v1/kind=runs/date=2026-11-28/host=h1").is_dir()


def test_rewrite_is_idempotent(tmp_path: Path) -> None:
    run, steps, events = make_run(steps=3)
    write_run(tmp_path, run, steps, events)
    again = run.model_copy(update={"charged_micros": 9999, "status": "failed"})
    write_run(tmp_path, again, steps[:1], [])
    records = Records(tmp_path)
    assert records.query("SELECT status, charged_micros FROM runs")[1] == [("failed", 9999)]
    assert records.query("SELECT count(*) FROM steps")[1] == [(1,)]
    # events were dropped in the rewrite: the stale file is gone rather than left behind
    assert records.query("SELECT count(*) FROM events")[1] == [(0,)]
    assert len(list(tmp_path.rglob("*.parquet"))) == 2


def test_writes_leave_no_temp_files_and_partial_temps_are_invisible(tmp_path: Path) -> None:
    run, steps, events = make_run()
    write_run(tmp_path, run, steps, events)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".parquet")]
    assert leftovers == []
    # what a writer killed mid-COPY leaves: a truncated hidden temp file next to the real one
    partition = tmp_path / f"v1/kind=runs/date={run.created_at.date()}/host=h1"
    real = (partition / f"{run.run_id}.parquet").read_bytes()
    (partition / f".{run.run_id}.{secrets.token_hex(6)}.tmp").write_bytes(real[: len(real) // 2])
    other, *_ = make_run()
    (partition / f".{other.run_id}.{secrets.token_hex(6)}.tmp").write_bytes(real)
    assert Records(tmp_path).query("SELECT run_id FROM runs")[1] == [(run.run_id,)]


def test_zero_data_retention_canary_never_reaches_disk(tmp_path: Path) -> None:
    canary = "CANARY" + secrets.token_hex(12)
    # the writer must drop content even when the caller forgot to
    run, steps, events = make_run(content=canary, zero_data_retention=True, steps=4)
    write_run(tmp_path / "zdr", run, steps, events)
    Records(tmp_path / "zdr").compact(older_than_days=0)
    files = _all_bytes(tmp_path / "zdr")
    assert files
    for path, data in files:
        assert canary.encode() not in data, path
    records = Records(tmp_path / "zdr")
    _, rows = records.query("SELECT prompt, output, checks, charged_micros FROM runs")
    assert rows == [(None, None, REMOVED_CHECKS, 3530)]
    _, rows = records.query("SELECT data FROM events WHERE type = 'shell.executed'")
    assert json.loads(rows[0][0]) == {
        "command_bytes": len(f"echo {canary}"),
        "stdout_bytes": len(canary),
        "stderr_bytes": 0,
        "exit_code": 0,
        "duration_ms": 4,
        "truncated": False,
    }

    # control: the same canary without ZDR is found by the same grep, so the check can fail
    run, steps, events = make_run(content=canary, steps=4)
    write_run(tmp_path / "plain", run, steps, events)
    found = {
        p.parent.parent.parent.name
        for p, d in _all_bytes(tmp_path / "plain")
        if canary.encode() in d
    }
    assert found == {"kind=runs", "kind=steps", "kind=events"}


def test_bad_identifiers_are_refused_with_the_field(tmp_path: Path) -> None:
    run, steps, events = make_run()
    with pytest.raises(ValidationError) as err:
        RunRecord(**{**run.model_dump(), "run_id": "../../etc/passwd"})
    assert err.value.errors()[0]["loc"] == ("run_id",)
    with pytest.raises(ValidationError) as err:
        RunRecord(**{**run.model_dump(), "host": "../up"})
    assert err.value.errors()[0]["loc"] == ("host",)
    other, *_ = make_run()
    stray = steps[1].model_copy(update={"run_id": other.run_id})
    with pytest.raises(InvalidRequest) as bad:
        write_run(tmp_path, run, [steps[0], stray], events)
    assert bad.value.errors == [
        {"field": "steps[1].run_id", "message": f"is {other.run_id!r}, expected {run.run_id!r}"}
    ]
    assert list(tmp_path.rglob("*.parquet")) == []


def test_undecodable_guest_text_is_stored_replaced(tmp_path: Path) -> None:
    run, steps, events = make_run()
    steps[0] = steps[0].model_copy(update={"stdout": "bytes \udcff here\x00nul"})
    write_run(tmp_path, run, steps, events)
    _, rows = Records(tmp_path).query("SELECT stdout FROM steps WHERE seq = 1")
    assert rows == [("bytes \ufffd here\x00nul",)]


def test_out_of_range_numbers_are_clamped_not_fatal(tmp_path: Path) -> None:
    run, steps, events = make_run()
    steps[0] = steps[0].model_copy(update={"duration_ms": 1 << 63, "exit_code": -(1 << 70)})
    run = run.model_copy(update={"input_tokens": 10**30})
    write_run(tmp_path, run, steps, events)
    recs = Records(tmp_path)
    _, rows = recs.query("SELECT duration_ms, exit_code FROM steps WHERE seq = 1")
    assert rows == [((1 << 63) - 1, -(1 << 63))]
    _, rows = recs.query("SELECT input_tokens FROM runs")
    assert rows == [((1 << 63) - 1,)]


def test_huge_step_output_is_capped_and_flagged(tmp_path: Path) -> None:
    from ephemeral.records.writer import MAX_STEP_TEXT_CHARS

    run, steps, events = make_run()
    steps[0] = steps[0].model_copy(update={"stdout": "x" * (MAX_STEP_TEXT_CHARS + 10)})
    write_run(tmp_path, run, steps, events)
    _, rows = Records(tmp_path).query("SELECT length(stdout), truncated FROM steps WHERE seq = 1")
    assert rows == [(MAX_STEP_TEXT_CHARS, True)]


def test_query_errors_name_the_sql(tmp_path: Path) -> None:
    records = Records(tmp_path)
    for sql in ("SELEC 1", "SELECT nope FROM runs", "SELECT * FROM no_such_table", "   "):
        with pytest.raises(InvalidRequest) as err:
            records.query(sql)
        assert err.value.errors and err.value.errors[0]["field"] == "sql"
    with pytest.raises(InvalidRequest) as err:
        records.query("SELECT * FROM read_csv('/etc/passwd')")
    assert "only the records" in err.value.detail
    outside = tmp_path.parent / f"outside-{secrets.token_hex(4)}.csv"
    with pytest.raises(InvalidRequest):
        records.query(f"COPY (SELECT 1) TO '{outside}'")
    assert not outside.exists()
    # the views are shared between calls, so nothing may change them
    for sql in (
        "DROP VIEW runs",
        "CREATE TABLE t AS SELECT 1",
        "SET threads = 1",
        "SELECT 1; DROP VIEW runs",
        "ATTACH ':memory:' AS x",
    ):
        with pytest.raises(InvalidRequest) as err:
            records.query(sql)
        assert err.value.errors and err.value.errors[0]["field"] == "sql"
    assert records.query("SELECT count(*) FROM runs")[1] == [(0,)]
    assert records.query("DESCRIBE steps")[1][2][:2] == ("kind", "VARCHAR")


def test_runs_of_other_days_land_in_their_partition(tmp_path: Path) -> None:
    for days in (0, 1, 1, 40):
        write_run(tmp_path, *make_run(days_ago=days))
    _, rows = Records(tmp_path).query('SELECT "date", count(*) FROM runs GROUP BY 1 ORDER BY 1')
    assert rows == [
        ((NOW - timedelta(days=40)).date(), 1),
        ((NOW - timedelta(days=1)).date(), 2),
        (NOW.date(), 1),
    ]


def test_files_from_before_a_column_existed_still_read(tmp_path: Path) -> None:
    import duckdb

    run, steps, events = make_run(days_ago=3)
    write_run(tmp_path, run, steps, events)
    path = tmp_path / f"v1/kind=runs/date={run.created_at.date()}/host=h1/{run.run_id}.parquet"
    # rewrite the file the way an older writer would have: without the `checks` column
    con = duckdb.connect()
    con.execute(f"COPY (SELECT * EXCLUDE (checks) FROM '{path}') TO '{path}.old' (FORMAT parquet)")
    con.close()
    Path(f"{path}.old").replace(path)
    write_run(tmp_path, *make_run(days_ago=3))  # and a current file beside it

    records = Records(tmp_path)
    _, rows = records.query("SELECT run_id, checks IS NULL FROM runs ORDER BY 2 DESC")
    assert rows[0] == (run.run_id, True) and len(rows) == 2
    assert records._union_by_name is True  # the slower schema-merging read was needed
    records.compact(older_than_days=0, now=NOW)  # rewrites everything in the current schema
    fresh = Records(tmp_path)
    assert fresh.query("SELECT count(*) FROM runs")[1] == [(2,)]
    assert fresh._union_by_name is False
