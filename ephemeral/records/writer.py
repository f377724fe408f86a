"""Write one settled run as its own Parquet files: atomic, idempotent, lock-free.

Each file is written by DuckDB (``COPY (select … from unnest(?)) TO``, ~4 ms a file) to a hidden
temp name in its partition directory and renamed over ``<run_id>.parquet``, so a reader sees the
old file or the new one, never half of one, and a retried settle overwrites rather than adds.
The views only match ``run_*.parquet`` and ``compacted.parquet``: a crashed writer's temp file
is invisible to them and removed by the next compaction.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb

from ephemeral.errors import InvalidRequest
from ephemeral.records.redact import redact_checks, redact_event_data, redact_verify
from ephemeral.records.schema import (
    EventRecord,
    RunRecord,
    StepRecord,
    columns,
    partition_dir,
)

# Sandbox output is capped by the guest protocol; this is the records' own backstop.
MAX_STEP_TEXT_CHARS = 1 << 20

_SURROGATE = re.compile("[\ud800-\udfff]")
# Every integer column is BIGINT. Values reach it from outside (a guest's reply, a provider's
# usage): those are bounded where they enter, and this clamp is the backstop that keeps one
# out-of-range number from failing the COPY and losing the whole run's records.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

_db: duckdb.DuckDBPyConnection | None = None
_db_pid = 0
_db_lock = threading.Lock()


def _cursor() -> duckdb.DuckDBPyConnection:
    """A cursor on one process-wide in-memory database (a fresh database costs 25-60 ms)."""
    global _db, _db_pid
    with _db_lock:
        if _db is None or _db_pid != os.getpid():  # never reuse a database across fork
            _db = duckdb.connect(":memory:")
            _db_pid = os.getpid()
            atexit.register(_close_db)
        return _db.cursor()


def _close_db() -> None:
    # Closed before interpreter teardown: left to finalisation, DuckDB's bindings report
    # "leaked" objects on stderr when other threads (Prefect's) are still alive.
    global _db
    with _db_lock:
        if _db is not None and _db_pid == os.getpid():
            _db.close()
        _db = None


def sql_str(value: str | Path) -> str:
    return "'" + str(value).replace("'", "''") + "'"


@functools.cache
def select_from_param(kind: str) -> str:
    """SELECT turning ``$1`` (a list of model dicts) into typed columns with physical names."""
    cols = ", ".join(
        f'CAST(s."{name}" AS {typ}) AS "{phys}"'
        for name, phys, typ in columns(kind)
        if name != "schema_version"
    )
    return f"SELECT {cols}, 1::INTEGER AS schema_version FROM (SELECT unnest($1) AS s)"


def _clean(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return min(INT64_MAX, max(INT64_MIN, value))
    # Lone surrogates (undecodable guest bytes) cannot be encoded as UTF-8 and would fail the write.
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return _SURROGATE.sub("\ufffd", value)
    return value


def _rows(records: Sequence[RunRecord | StepRecord | EventRecord]) -> list[dict[str, Any]]:
    return [{k: _clean(v) for k, v in r.model_dump().items()} for r in records]


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(target: Path) -> Path:
    """Hidden, unique, same directory (so the rename is atomic), never matched by the views."""
    return target.with_name(f".{target.stem}.{secrets.token_hex(6)}.tmp")


def copy_rows(
    cur: duckdb.DuckDBPyConnection, kind: str, rows: list[dict[str, Any]], target: Path
) -> None:
    tmp = temp_name(target)
    try:
        cur.execute(f"COPY ({select_from_param(kind)}) TO {sql_str(tmp)} (FORMAT parquet)", [rows])
        fsync_file(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _enforce_zdr(
    run: RunRecord, steps: list[StepRecord], events: list[EventRecord]
) -> tuple[RunRecord, list[StepRecord], list[EventRecord]]:
    run = run.model_copy(
        update={
            "prompt": None,
            "output": None,
            "checks": redact_checks(run.checks),
            "verify": redact_verify(run.verify),
        }
    )
    steps = [s.model_copy(update={"command": None, "stdout": None, "stderr": None}) for s in steps]
    events = [e.model_copy(update={"data": redact_event_data(e.data)}) for e in events]
    return run, steps, events


def _cap_steps(steps: list[StepRecord]) -> list[StepRecord]:
    out = []
    for s in steps:
        long = {
            k: v[:MAX_STEP_TEXT_CHARS]
            for k in ("command", "stdout", "stderr")
            if isinstance(v := getattr(s, k), str) and len(v) > MAX_STEP_TEXT_CHARS
        }
        out.append(s.model_copy(update={**long, "truncated": True}) if long else s)
    return out


def _check_ids(run: RunRecord, steps: list[StepRecord], events: list[EventRecord]) -> None:
    groups: tuple[tuple[str, Sequence[StepRecord | EventRecord]], ...] = (
        ("steps", steps),
        ("events", events),
    )
    for name, items in groups:
        for i, item in enumerate(items):
            if item.run_id != run.run_id:
                raise InvalidRequest.field(
                    f"{name}[{i}].run_id", f"is {item.run_id!r}, expected {run.run_id!r}"
                )


def write_run(
    records_dir: Path,
    run: RunRecord,
    steps: list[StepRecord],
    events: list[EventRecord],
) -> list[Path]:
    """Write (or rewrite) one run's files; returns the paths written.

    Steps and events go first and the run row last, so a reader that sees the run also sees its
    steps. A kind with no rows gets no file, and a stale file from an earlier write is removed.
    """
    _check_ids(run, steps, events)
    if run.zero_data_retention:
        # The caller already drops content; doing it again here means one forgotten field
        # upstream cannot put a zero-data-retention prompt on disk.
        run, steps, events = _enforce_zdr(run, steps, events)
    steps = _cap_steps(steps)
    day = run.created_at.date()  # created_at is UTC (schema validator)
    written: list[Path] = []
    cur = _cursor()
    try:
        for kind, records in (("steps", steps), ("events", events), ("runs", [run])):
            directory = partition_dir(records_dir, kind, day, run.host)
            target = directory / f"{run.run_id}.parquet"
            if not records:
                target.unlink(missing_ok=True)
                continue
            directory.mkdir(parents=True, exist_ok=True)
            copy_rows(cur, kind, _rows(records), target)
            written.append(target)
    finally:
        cur.close()
    return written
