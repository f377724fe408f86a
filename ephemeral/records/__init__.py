"""Recorded runs for analysis: per-run Parquet files, DuckDB views, compaction and retention.

Layout, columns and units: ``docs/records.md``. Writers (the settle/record task) call
:func:`write_run`; everything that reads goes through :class:`Records`.
"""

from __future__ import annotations

from ephemeral.records.reader import (
    COST_COLUMNS,
    COST_DIMENSIONS,
    Records,
    cost_dimensions,
    parse_since,
)
from ephemeral.records.schema import (
    KINDS,
    SCHEMA_VERSION,
    EventRecord,
    RunRecord,
    StepRecord,
)
from ephemeral.records.writer import write_run

__all__ = [
    "COST_COLUMNS",
    "COST_DIMENSIONS",
    "KINDS",
    "SCHEMA_VERSION",
    "EventRecord",
    "Records",
    "RunRecord",
    "StepRecord",
    "cost_dimensions",
    "parse_since",
    "write_run",
]
