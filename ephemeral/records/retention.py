"""Retention: content older than N days is removed; billing figures, tokens and times stay.

A partition old enough to hold expired content is first compacted (so the content lives in one
file the purge can rewrite under the partition lock; fresh files are never rewritten, because
a writer could be replacing them), then its compacted file is rewritten with content nulled for
rows older than the cutoff: run prompt and output and check reasons (by ``created_at``), step
command, stdout and stderr, and the content keys of event data (by ``at``). A run settled late
into an old partition is purged by the next pass.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb

from ephemeral.errors import InvalidRequest
from ephemeral.events import CONTENT_KEYS
from ephemeral.ids import utcnow
from ephemeral.records.compaction import (
    compact_locked,
    partition_lock,
    partitions,
    read_files,
    rewrite_compacted,
)
from ephemeral.records.redact import (
    REMOVED_REASON,
    redact_checks,
    redact_event_data,
    redact_verify,
)
from ephemeral.records.schema import COMPACTED_NAME, CONTENT_COLUMNS, columns
from ephemeral.records.writer import _cursor

_TIME_COLUMN = {"runs": "created_at", "steps": '"at"', "events": '"at"'}
_KEY = {"runs": ("run_id",), "steps": ("run_id", "seq"), "events": ("run_id", "seq")}
# A cheap SQL filter for rows that may still hold content; Python decides for each candidate.
_CANDIDATE = {
    "runs": "prompt IS NOT NULL OR output IS NOT NULL OR "
    f"replace(checks, '\"reason\": \"{REMOVED_REASON}\"', '') LIKE '%\"reason\"%' OR "
    "verify LIKE '%\"command\"%'",
    "steps": "command IS NOT NULL OR stdout IS NOT NULL OR stderr IS NOT NULL",
    "events": " OR ".join(f"data LIKE '%\"{key}\"%'" for key in sorted(CONTENT_KEYS)),
}


def _purged(kind: str, row: dict[str, Any]) -> dict[str, Any]:
    if kind == "runs":
        return {
            **row,
            "prompt": None,
            "output": None,
            "checks": redact_checks(row["checks"]),
            "verify": redact_verify(row["verify"]),
        }
    if kind == "steps":
        return {**row, "command": None, "stdout": None, "stderr": None}
    return {**row, "data": redact_event_data(row["data"])}


def _purge_compacted(
    con: duckdb.DuckDBPyConnection, kind: str, directory: Path, cutoff: datetime
) -> int:
    compacted = directory / COMPACTED_NAME
    if not compacted.exists():
        return 0
    content = CONTENT_COLUMNS[kind] + (("checks", "verify") if kind == "runs" else ())
    keys = _KEY[kind]
    source = f"({read_files(kind, [compacted])})"
    cur = con.execute(
        f"SELECT {', '.join(keys + content)} FROM {source} "
        f"WHERE {_TIME_COLUMN[kind]} < $1 AND ({_CANDIDATE[kind]})",
        [cutoff],
    )
    names = [d[0] for d in cur.description or []]
    changes = []
    for values in cur.fetchall():
        row = dict(zip(names, values, strict=True))
        purged = _purged(kind, row)
        if purged != row:
            changes.append(purged)
    if not changes:
        return 0
    join = " AND ".join(f"t.{k} = p.{k}" for k in keys)
    cols = ", ".join(
        f'CASE WHEN p.run_id IS NOT NULL THEN p."{phys}" ELSE t."{phys}" END AS "{phys}"'
        if phys in content
        else f't."{phys}"'
        for _, phys, _ in columns(kind)
    )
    select = (
        f"SELECT {cols} FROM {source} AS t "
        f"LEFT JOIN (SELECT unnest($1, recursive := true)) AS p ON {join}"
    )
    rewrite_compacted(con, kind, directory, select, [changes])
    return len(changes)


def purge_content(
    records_dir: Path, retention_days: int = 30, *, now: datetime | None = None
) -> int:
    """Purge content older than ``retention_days``; returns the number of records changed."""
    if retention_days < 0:
        raise InvalidRequest.field("retention_days", "must be 0 or more")
    cutoff = (now or utcnow()).astimezone(UTC) - timedelta(days=retention_days)
    purged = 0
    con = _cursor()
    try:
        # A partition is dated by its runs' created_at, and every step and event of a run comes
        # after it, so partitions dated after the cutoff hold nothing to purge.
        for kind, _, directory in partitions(records_dir, cutoff.date()):
            with partition_lock(directory) as locked:
                if not locked:
                    continue
                compact_locked(kind, directory)
                purged += _purge_compacted(con, kind, directory, cutoff)
    finally:
        con.close()
    return purged
