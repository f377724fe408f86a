"""Schema v1 of the recorded runs: the three record kinds, their columns and their place on disk.

One settled run is three Parquet files, one per kind::

    <records_dir>/v1/kind=runs/date=YYYY-MM-DD/host=<host>/<run_id>.parquet
    <records_dir>/v1/kind=steps/date=YYYY-MM-DD/host=<host>/<run_id>.parquet
    <records_dir>/v1/kind=events/date=YYYY-MM-DD/host=<host>/<run_id>.parquet

``date`` is the UTC date of the run's ``created_at`` and ``host`` the run's host, so a run's
partition never changes when its files are rewritten. Compaction folds the per-run files of a
partition into ``compacted.parquet`` in the same directory (see ``compaction.py``).
"""

from __future__ import annotations

import functools
import re
import types
import typing
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from ephemeral.errors import InvalidRequest
from ephemeral.ids import RUN_ID_RE

SCHEMA_VERSION = 1
KINDS = ("runs", "steps", "events")
COMPACTED_NAME = "compacted.parquet"
FRESH_GLOB = "run_*.parquet"
# A host name becomes a directory name: no separators, no dot-files, nothing to escape.
HOST_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,252}$")


def _utc(value: datetime | None) -> datetime | None:
    # SQLite hands back naive datetimes; every time we store is UTC, so naive means UTC.
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("run_id", check_fields=False)
    @classmethod
    def _run_id(cls, v: str) -> str:
        # The run id is a file name: anything but the canonical form could escape the partition.
        if not RUN_ID_RE.match(v):
            raise ValueError("must be 'run_' followed by 32 lowercase hex digits")
        return v


class RunRecord(_Record):
    """kind=runs: one row per run. Money in integer micro-dollars, durations in milliseconds."""

    run_id: str
    org_id: str
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    status: str
    termination_reason: str | None
    model: str
    isolation: str | None
    recipe: str | None = None
    recipe_cell: str | None = None  # JSON text
    repeat_index: int | None = None
    suite_run_id: str | None = None
    zero_data_retention: bool
    prompt: str | None  # None under zero data retention or after the retention purge
    output: str | None  # idem
    model_calls: int
    input_tokens: int
    output_tokens: int
    reserved_micros: int
    charged_micros: int
    refunded_micros: int
    model_micros: int
    web_micros: int
    compute_micros: int
    duration_ms: int | None
    checks: str | None = None  # JSON text
    # pass / fail / error / cancelled / budget (ephemeral.engine.outcomes); None in files written
    # before the column existed
    outcome: str | None = None
    # JSON text: the run's string labels (ephemeral.labels; the system's and the caller's)
    labels: str | None = None
    host: str
    image: str | None = None  # the image's name and definition hash (sandbox.ready)
    image_hash: str | None = None
    verify: str | None = None  # JSON text: [{command, exit_code, duration_ms, timed_out, ...}]

    kind: str = "run"  # "run" or "session" (a sandbox session, ephemeral.sessions.manager)

    @field_validator("created_at", "started_at", "ended_at")
    @classmethod
    def _times(cls, v: datetime | None) -> datetime | None:
        return _utc(v)

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        if not HOST_RE.match(v):
            raise ValueError("must be 1-253 characters of letters, digits, '.', '_' or '-'")
        return v


class StepRecord(_Record):
    """kind=steps: one row per model call, shell command, web request or connection call."""

    run_id: str
    seq: int
    kind: Literal["model", "shell", "web", "connection"]
    at: datetime
    duration_ms: int
    command: str | None
    exit_code: int | None
    stdout: str | None
    stderr: str | None
    truncated: bool | None
    model: str | None
    input_tokens: int | None
    output_tokens: int | None
    cost_micros: int

    @field_validator("at")
    @classmethod
    def _at(cls, v: datetime) -> datetime | None:
        return _utc(v)


class EventRecord(_Record):
    """kind=events: the run's timeline, one row per event; ``data`` is the event's JSON."""

    run_id: str
    seq: int
    type: str
    at: datetime
    data: str  # JSON text

    @field_validator("at")
    @classmethod
    def _at(cls, v: datetime) -> datetime | None:
        return _utc(v)


MODELS: dict[str, type[_Record]] = {"runs": RunRecord, "steps": StepRecord, "events": EventRecord}

# Columns whose values are content (what the run saw or said), as opposed to billing and timing.
CONTENT_COLUMNS: dict[str, tuple[str, ...]] = {
    "runs": ("prompt", "output"),
    "steps": ("command", "stdout", "stderr"),
    "events": ("data",),
}

# The partition directories are named kind=…, date=…, host=…, and hive-aware readers (DuckDB,
# Spark, pandas) let the directory value win over a column of the same name. The step's own
# ``kind`` would be overwritten by "steps", so in the files it is called ``step_kind``.
PHYSICAL_NAMES: dict[str, dict[str, str]] = {
    "steps": {"kind": "step_kind"},
    "runs": {"kind": "run_kind"},
}

_SCALAR_TYPES: dict[type, str] = {
    str: "VARCHAR",
    int: "BIGINT",
    bool: "BOOLEAN",
    datetime: "TIMESTAMPTZ",
}


def _duckdb_type(annotation: object) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _duckdb_type(args[0])
    if origin is Literal:
        return "VARCHAR"
    if isinstance(annotation, type) and annotation in _SCALAR_TYPES:
        return _SCALAR_TYPES[annotation]
    raise TypeError(f"no DuckDB type for {annotation!r}")


@functools.cache
def columns(kind: str) -> tuple[tuple[str, str, str], ...]:
    """(logical name, physical name in the files, DuckDB type) for every stored column."""
    renames = PHYSICAL_NAMES.get(kind, {})
    out = [
        (name, renames.get(name, name), _duckdb_type(field.annotation))
        for name, field in MODELS[kind].model_fields.items()
    ]
    out.append(("schema_version", "schema_version", "INTEGER"))
    return tuple(out)


def partition_dir(records_dir: Path, kind: str, day: date, host: str) -> Path:
    return kind_dir(records_dir, kind) / f"date={day:%Y-%m-%d}" / f"host={host}"


def kind_dir(records_dir: Path, kind: str) -> Path:
    return records_dir / f"v{SCHEMA_VERSION}" / f"kind={kind}"


def parse_partition_date(name: str) -> date | None:
    """``date=2026-11-28`` -> date; anything else (temp dirs, stray files) -> None."""
    if not name.startswith("date="):
        return None
    try:
        return date.fromisoformat(name[5:])
    except ValueError:
        return None


def check_kind(kind: str) -> str:
    if kind not in MODELS:
        raise InvalidRequest.field("kind", f"must be one of {', '.join(KINDS)}, not {kind!r}")
    return kind
