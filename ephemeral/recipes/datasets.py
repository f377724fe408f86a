"""Dataset files for recipes: each row of a ``.jsonl``, ``.csv`` or ``.parquet`` file is a cell.

DuckDB reads the file into an in-memory table of a private connection, and then that connection
loses every way out: ``enable_external_access`` off and the configuration locked. Only then does
the recipe's ``dataset_filter`` (a SQL predicate) run, so a filter can read the rows and nothing
else: no file, no other database, no setting it could change. The predicate is parsed by DuckDB
inside ``SELECT * FROM ds WHERE (…)`` and must be that one SELECT's WHERE and nothing more
(:func:`check_filter`); the statement that runs is printed back from the parsed tree.

Rows stream to Python in batches (:func:`iter_rows`); a 100,000-row file never becomes 100,000
Python objects at once. Each row carries its 1-based line in the file (``row``), which every
error about it names. Sampling (``dataset_sample: {n, seed}``) is DuckDB's reservoir sample with
a fixed seed on one thread, so the same seed picks the same rows; picked rows keep file order.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
from pydantic import BaseModel, ConfigDict, Field

from ephemeral.errors import InvalidRequest

MAX_FILTER_CHARS = 2_000
MAX_DATASET_BYTES = 2 << 30
BATCH = 2_000
_ROW = "__ephemeral_row"
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_READERS = {
    ".jsonl": "read_json({path}, format = 'newline_delimited')",
    ".ndjson": "read_json({path}, format = 'newline_delimited')",
    ".csv": "read_csv({path}, header = true)",
    ".parquet": "read_parquet({path})",
}


class Sample(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    n: int = Field(ge=1)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)


def _problem(field: str, message: str) -> InvalidRequest:
    """A dataset problem naming the recipe field it belongs to (``errors[0].field``)."""
    return InvalidRequest.field(field, message)


class Selection(BaseModel):
    """Which rows of which file: the recipe's ``dataset*`` fields, the path resolved."""

    model_config = ConfigDict(frozen=True)
    path: Path
    filter: str | None = None
    limit: int | None = None
    sample: Sample | None = None


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _open(sel: Selection) -> duckdb.DuckDBPyConnection:
    reader = _READERS.get(sel.path.suffix.lower())
    if reader is None:
        raise _problem("dataset", f"{sel.path}: must end in .jsonl, .csv or .parquet")
    try:
        size = sel.path.stat().st_size
    except OSError as exc:
        raise _problem("dataset", f"{sel.path}: {exc.strerror or exc}") from None
    if size > MAX_DATASET_BYTES:
        raise _problem("dataset", f"{sel.path}: larger than {MAX_DATASET_BYTES} bytes")
    con = duckdb.connect(":memory:")
    try:
        # one thread: file order and a seeded sample are then the same on every run
        con.execute("SET threads = 1")
        con.execute("SET enable_progress_bar = false")  # it would draw on the CLI's stderr
        source = reader.format(path=_literal(str(sel.path)))
        con.execute(f"CREATE TABLE ds AS SELECT row_number() OVER () AS {_ROW}, * FROM {source}")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except duckdb.Error as exc:
        con.close()
        raise _problem("dataset", f"{sel.path}: {_first_line(exc)}") from None
    return con


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:500] if str(exc).strip() else type(exc).__name__


# Functions a filter may not call even though external access is off: whatever reads files,
# settings, the catalog or runs SQL text of its own.
_FORBIDDEN_FUNCTION = re.compile(
    r"^(read_|glob$|getenv$|query$|query_table$|sniff_csv$|parquet_|iceberg_|delta_|duckdb_"
    r"|pragma_|current_setting$|which_secret$|json_execute_serialized_sql$|json_serialize|"
    r"json_deserialize|sql_auto_complete$|load_|install_|checkpoint$|force_checkpoint$)",
    re.IGNORECASE,
)
_WRAPPER = "SELECT * FROM ds WHERE ({})"


def _parse(sql: str) -> dict[str, Any]:
    con = duckdb.connect(":memory:")
    try:
        row = con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()
        return dict(json.loads(row[0])) if row else {"error": True}
    finally:
        con.close()


def _bad_node(node: Any) -> str | None:
    """What in a WHERE expression tree is not a plain expression over the row, if anything."""
    if isinstance(node, list):
        return next((why for item in node if (why := _bad_node(item)) is not None), None)
    if not isinstance(node, dict):
        return None
    if node.get("class") == "SUBQUERY" or "subquery" in node or "node" in node:
        return "a subquery"
    if node.get("class") in {"STAR", "PARAMETER", "LAMBDA_REF"} or node.get("type") == "STAR":
        return f"a {str(node['class']).lower()}"
    name = node.get("function_name")
    if isinstance(name, str) and _FORBIDDEN_FUNCTION.match(name):
        return f"the function {name}"
    return next((why for v in node.values() if (why := _bad_node(v)) is not None), None)


def check_filter(predicate: str) -> str:
    """The ``SELECT`` of the rows a predicate picks, as DuckDB prints the parsed statement.

    ``SELECT * FROM ds WHERE (<predicate>)`` must parse (DuckDB's own parser) to exactly one
    plain ``SELECT`` of ``ds`` whose only clause is that WHERE: no set operation, no ORDER BY,
    GROUP BY, HAVING, LIMIT, QUALIFY or sample closed in after a parenthesis, no subquery and no
    function that reads files or settings. What runs is the statement printed back from that
    tree, never the predicate's text."""
    if len(predicate) > MAX_FILTER_CHARS:
        raise _problem("dataset_filter", f"longer than {MAX_FILTER_CHARS} characters")
    if ";" in predicate or "--" in predicate or "/*" in predicate:
        raise _problem("dataset_filter", "must be one SQL predicate (no ;, no comments)")
    tree = _parse(_WRAPPER.format(predicate))
    if tree.get("error"):
        kind = str(tree.get("error_type", "")).capitalize()
        raise _problem(
            "dataset_filter", f"not a SQL predicate: {kind} Error: {tree.get('error_message')}"
        )
    statements = tree.get("statements") or []
    node = statements[0].get("node", {}) if len(statements) == 1 else {}
    plain = (
        node.get("type") == "SELECT_NODE"
        and not node.get("modifiers")
        and not node.get("cte_map", {}).get("map")
        and [i.get("class") for i in node.get("select_list", [])] == ["STAR"]
        and node.get("from_table", {}).get("type") == "BASE_TABLE"
        and node["from_table"].get("table_name") == "ds"
        and not node["from_table"].get("sample")
        and not node.get("group_expressions")
        and not node.get("group_sets")
        and all(node.get(k) is None for k in ("having", "sample", "qualify"))
        and node.get("where_clause") is not None
    )
    if not plain:
        closed = "must be one SQL predicate (it closes its parenthesis to add a clause)"
        raise _problem("dataset_filter", closed)
    why = _bad_node(node["where_clause"])
    if why is not None:
        raise _problem("dataset_filter", f"must be a predicate over the row's columns, not {why}")
    con = duckdb.connect(":memory:")
    try:
        printed = con.execute("SELECT json_deserialize_sql(?)", [json.dumps(tree)]).fetchone()
    finally:
        con.close()
    return str(printed[0]) if printed else _WRAPPER.format("false")


def _query(sel: Selection, what: str) -> str:
    picked = check_filter(sel.filter) if sel.filter else "SELECT * FROM ds"
    if sel.sample is not None:
        picked = (
            f"SELECT * FROM ({picked}) USING SAMPLE reservoir({sel.sample.n} ROWS) "
            f"REPEATABLE ({sel.sample.seed})"
        )
    limit = f"LIMIT {sel.limit}" if sel.limit is not None else ""
    return f"SELECT {what} FROM (SELECT * FROM ({picked}) ORDER BY {_ROW} {limit})"


def _run(con: duckdb.DuckDBPyConnection, sel: Selection, what: str) -> duckdb.DuckDBPyConnection:
    query = _query(sel, what)
    try:
        return con.execute(query)
    except duckdb.Error as exc:
        field = "dataset_filter" if sel.filter else "dataset"
        raise _problem(field, f"{sel.path}: {_first_line(exc)}") from None


def columns(sel: Selection) -> list[str]:
    con = _open(sel)
    try:
        names = [d[0] for d in _run(con, sel, "*").description or []]
    finally:
        con.close()
    return [n for n in names if n != _ROW]


def count(sel: Selection) -> int:
    con = _open(sel)
    try:
        row = _run(con, sel, "count(*)").fetchone()
    finally:
        con.close()
    return int(row[0]) if row else 0


def iter_rows(sel: Selection) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row number in the file, {column: value})`` for every selected row, in file order."""
    con = _open(sel)
    try:
        cur = _run(con, sel, "*")
        names = [d[0] for d in cur.description or []]
        while batch := cur.fetchmany(BATCH):
            for values in batch:
                row = dict(zip(names, values, strict=True))
                number = int(row.pop(_ROW))
                yield number, {k: _plain(v, sel.path, number, k) for k, v in row.items()}
    finally:
        con.close()


def _plain(value: Any, path: Path, row: int, column: str) -> Any:
    """A JSON-able value for templates, labels and records."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _problem("dataset", f"{path}: row {row}: {column} is {value}")
        return value
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return [_plain(v, path, row, column) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, path, row, column) for k, v in value.items()}
    raise _problem(
        "dataset", f"{path}: row {row}: {column} is a {type(value).__name__}, not text or a number"
    )


def bad_columns(names: list[str], taken: set[str]) -> list[str]:
    """Column names that cannot be template variables, each with the reason."""
    out = []
    for name in names:
        if not _IDENT.match(name):
            out.append(f"column {name!r} is not an identifier (letters, digits, _)")
        elif name in taken:
            out.append(f"column {name!r} is also a variable of the recipe (vars, matrix, model)")
    return out
