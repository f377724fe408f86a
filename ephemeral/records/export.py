"""The sample set of a suite run: one row per run, from the records, as JSONL or Parquet.

``ephemeral export SUITE_RUN_ID`` reads the recorded runs (DuckDB over the Parquet records, see
``ephemeral.records``) of one suite run and writes them with DuckDB's ``COPY``: the file is
written under a temporary name next to ``out`` and renamed, so a reader never sees half of it.

Zero data retention: the records of such a run hold no prompt, output, command or verify
output, and the export adds none: those columns are null and each check reason is the ZDR
placeholder; status, verdicts, exit codes, tokens and money remain.

Each row's ``outcome`` (pass / fail / error / cancelled / budget, ``ephemeral.engine.outcomes``) is
the one the records hold; ``passed`` is ``outcome = 'pass'``, so an infrastructure error is neither
a pass nor a fail.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import duckdb

from ephemeral import errors
from ephemeral.records import Records

Format = Literal["jsonl", "parquet"]
FORMATS: tuple[Format, ...] = ("jsonl", "parquet")

# One row per run, in plan order (recipe, then cell, then repeat); JSON text columns become
# JSON values, so a JSONL line holds objects, not strings of JSON. ``epochs`` is how many runs
# the run's cell had (``eval --repeat K``) and ``cell_pass_at_k`` whether any of them passed.
_RUNS = """
SELECT
    recipe_cell AS cell_key,
    run_id,
    suite_run_id,
    recipe,
    recipe_cell::JSON AS cell,
    model,
    repeat_index AS "repeat",
    status,
    termination_reason,
    CASE WHEN zero_data_retention THEN NULL ELSE prompt END AS prompt,
    CASE WHEN zero_data_retention THEN NULL ELSE output END AS output,
    outcome,
    outcome = 'pass' AS passed,
    checks::JSON AS verdicts,
    labels::JSON AS labels,
    verify::JSON AS verify,
    model_calls,
    input_tokens,
    output_tokens,
    charged_micros,
    model_micros,
    web_micros,
    compute_micros,
    duration_ms,
    image,
    image_hash,
    host,
    isolation,
    zero_data_retention,
    created_at
FROM runs
WHERE suite_run_id = $1
"""

COLUMNS = (
    "run_id",
    "suite_run_id",
    "recipe",
    "cell",
    "model",
    "repeat",
    "status",
    "termination_reason",
    "prompt",
    "output",
    "outcome",
    "passed",
    "verdicts",
    "labels",
    "verify",
    "model_calls",
    "input_tokens",
    "output_tokens",
    "charged_micros",
    "model_micros",
    "web_micros",
    "compute_micros",
    "duration_ms",
    "image",
    "image_hash",
    "host",
    "isolation",
    "zero_data_retention",
    "created_at",
    "epochs",
    "cell_pass_at_k",
)
_SELECT = f"""
SELECT {", ".join(f'"{c}"' for c in COLUMNS[:-2])},
    count(*) OVER cell AS epochs,
    bool_or(passed) OVER cell AS cell_pass_at_k
FROM ({_RUNS})
WINDOW cell AS (PARTITION BY recipe, cell_key, model)
ORDER BY recipe, cell_key, "repeat", model, run_id
"""


def export_suite_run(records_dir: Path, suite_run_id: str, out: Path, fmt: Format = "jsonl") -> int:
    """Write the suite run's sample set to ``out``; returns the number of rows."""
    if fmt not in FORMATS:
        raise errors.InvalidRequest.field("format", f"must be one of {', '.join(FORMATS)}")
    # COPY takes no parameters: the id goes in as a literal, so its shape is checked first.
    if not suite_run_id or not suite_run_id.replace("_", "").isalnum():
        raise errors.InvalidRequest.field("suite_run_id", "letters, digits and _ only")
    records = Records(records_dir)
    con = records.connect()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        count = con.execute(
            "SELECT count(*) FROM runs WHERE suite_run_id = $1", [suite_run_id]
        ).fetchone()
        if not count or count[0] == 0:
            raise errors.NotFound(f"no recorded runs for suite run {suite_run_id!r}")
        options = "FORMAT json" if fmt == "jsonl" else "FORMAT parquet"
        out.parent.mkdir(parents=True, exist_ok=True)
        sql = _SELECT.replace("$1", f"'{suite_run_id}'")
        con.execute(f"COPY ({sql}) TO '{_quote(tmp)}' ({options})")
        os.replace(tmp, out)
        return int(count[0])
    except duckdb.Error as exc:
        raise errors.EphemeralError(f"export failed: {str(exc).splitlines()[0]}") from exc
    finally:
        con.close()
        tmp.unlink(missing_ok=True)


def _quote(path: Path) -> str:
    return str(path).replace("'", "''")
