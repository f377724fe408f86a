"""The DuckDB views ``runs``, ``steps`` and ``events`` over the Parquet tree.

Each view reads two globs per kind: the fresh per-run files (``run_*.parquet``) and the
compacted files (``compacted.parquet``). A run is shown from its fresh file when it has one and
from the compacted file otherwise; that single rule is what makes compaction and late rewrites
safe for readers (see ``compaction.py`` for the full argument):

    WITH fresh AS MATERIALIZED (<fresh glob>)          -- one listing, used twice
    SELECT * FROM fresh
    UNION ALL
    SELECT * FROM <compacted glob> ANTI JOIN fresh USING (run_id)

An empty "schema file" per kind (zero rows, every column typed) is always part of both reads, so
the views bind with the right columns and types on an empty store, after every fresh file has
been compacted away, and over files written by an older schema that lack a newer column.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path

from ephemeral.records.schema import (
    COMPACTED_NAME,
    FRESH_GLOB,
    KINDS,
    SCHEMA_VERSION,
    columns,
    kind_dir,
)
from ephemeral.records.writer import _cursor, sql_str

_HIVE_TYPES = "{'kind': VARCHAR, 'date': DATE, 'host': VARCHAR}"
_schema_root: Path | None = None
_schema_lock = threading.Lock()


def schema_files() -> dict[str, Path]:
    """Per-process typed empty Parquet file per kind, laid out with the same hive keys."""
    global _schema_root
    with _schema_lock:
        root = _schema_root
        paths = {k: _schema_path(root, k) for k in KINDS} if root else {}
        if root is None or not all(p.exists() for p in paths.values()):
            root = Path(tempfile.mkdtemp(prefix="ephemeral-records-schema-"))
            atexit.register(_remove_if_owner, root, os.getpid())
            paths = {k: _schema_path(root, k) for k in KINDS}
            cur = _cursor()
            try:
                for kind, path in paths.items():
                    path.parent.mkdir(parents=True)
                    cols = ", ".join(
                        f'CAST(NULL AS {typ}) AS "{phys}"' for _, phys, typ in columns(kind)
                    )
                    cur.execute(f"COPY (SELECT {cols} LIMIT 0) TO {sql_str(path)} (FORMAT parquet)")
            finally:
                cur.close()
            _schema_root = root
        return paths


def _remove_if_owner(root: Path, pid: int) -> None:
    # A forked child inherits atexit handlers; only the creating process may remove the files.
    if os.getpid() == pid:
        shutil.rmtree(root, ignore_errors=True)


def schema_root() -> Path:
    schema_files()
    assert _schema_root is not None
    return _schema_root


def _schema_path(root: Path, kind: str) -> Path:
    return (
        root
        / f"v{SCHEMA_VERSION}"
        / f"kind={kind}"
        / "date=1970-01-01"
        / "host=_schema"
        / "_schema.parquet"
    )


def typed_select(kind: str, *, logical: bool) -> str:
    """Column list casting every stored column to its declared type.

    ``logical`` names columns as the models do (``steps.kind``) and adds the partition columns;
    otherwise columns keep their physical names, for rewriting files.
    """
    parts = [
        f'CAST("{phys}" AS {typ}) AS "{name if logical else phys}"'
        for name, phys, typ in columns(kind)
    ]
    if logical:
        parts.append('"date"')
        if kind != "runs":  # runs carry host as a column of their own
            parts.append('"host"')
    return ", ".join(parts)


def _read(records_dir: Path, kind: str, pattern: str, union_by_name: bool) -> str:
    glob = kind_dir(records_dir, kind) / "*" / "*" / pattern
    schema = schema_files()[kind]
    return (
        f"read_parquet([{sql_str(schema)}, {sql_str(glob)}], hive_partitioning=true, "
        f"union_by_name={str(union_by_name).lower()}, allow_empty=true, "
        f"hive_types={_HIVE_TYPES})"
    )


def view_sql(records_dir: Path, kind: str, *, union_by_name: bool = False) -> str:
    """The view of one kind.

    Every file this version writes has exactly the schema file's columns, so DuckDB can take
    the schema from the schema file and open the data files only when it reads them (files are
    matched by column name). ``union_by_name`` opens every file at bind time to merge schemas:
    3-5x slower, needed only for files from before a column was added (see docs/records.md).
    """
    cols = typed_select(kind, logical=True)
    fresh = _read(records_dir, kind, FRESH_GLOB, union_by_name)
    compacted = _read(records_dir, kind, COMPACTED_NAME, union_by_name)
    return (
        f"CREATE OR REPLACE VIEW {kind} AS "
        f"WITH fresh AS MATERIALIZED (SELECT {cols} FROM {fresh}) "
        f"SELECT * FROM fresh UNION ALL "
        f"SELECT c.* FROM (SELECT {cols} FROM {compacted}) AS c "
        f"ANTI JOIN fresh AS f ON c.run_id = f.run_id"
    )
