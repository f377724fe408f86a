"""Read side of the records: DuckDB connections with the views, SQL queries, cost roll-ups."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb

from ephemeral.errors import EphemeralError, InvalidRequest
from ephemeral.ids import utcnow
from ephemeral.labels import valid_key
from ephemeral.records import compaction, retention
from ephemeral.records.schema import KINDS
from ephemeral.records.views import schema_root, view_sql

# A query holds the readers lock, so compaction cannot retire a file it listed; it can still race
# a rewrite: a run rewritten with no steps loses its file, or a file was replaced between two
# reads of it (DuckDB then fails on the footer). Those are errors, not wrong answers; the next
# attempt lists and opens the files again.
_ATTEMPTS = 5
_TRANSIENT = (
    "No such file or directory",
    "TProtocolException",
    "No magic bytes",
    "Could not read enough bytes",
)
# Files from before a column was added; the views then merge schemas by name (slower).
_SCHEMA_MISMATCH = "schema mismatch in glob"
_READ_ONLY = (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN)

COST_DIMENSIONS: dict[str, str] = {
    "model": "model",
    "recipe": "coalesce(recipe, '(none)')",
    "day": "strftime(\"date\", '%Y-%m-%d')",
    "org": "org_id",
    "status": "status",
    "kind": "coalesce(kind, 'run')",
}
MAX_COST_DIMENSIONS = 4
LABEL_PREFIX = "label:"


def cost_dimensions(by: str | Sequence[str]) -> list[tuple[str, str, str | None]]:
    """``model,recipe,label:team`` (or a list of such, as repeated ``--by`` give) as
    ``(name, SQL expression, parameter)`` per dimension, in order, each at most once.

    ``label:KEY`` groups by the run's label ``KEY`` (``(none)`` where it has none).
    """
    names = [n.strip() for part in ([by] if isinstance(by, str) else by) for n in part.split(",")]
    if not names or any(not n for n in names):
        raise InvalidRequest.field("by", "name one or more dimensions, separated by commas")
    if len(names) > MAX_COST_DIMENSIONS:
        raise InvalidRequest.field("by", f"at most {MAX_COST_DIMENSIONS} dimensions")
    if len(set(names)) != len(names):
        raise InvalidRequest.field("by", "a dimension is named twice")
    out: list[tuple[str, str, str | None]] = []
    for name in names:
        if name.startswith(LABEL_PREFIX):
            key = name.removeprefix(LABEL_PREFIX)
            if not valid_key(key):
                raise InvalidRequest.field(
                    "by", f"{name!r}: a label key is 1-63 of A-Z a-z 0-9 _ . - (not first)"
                )
            path = f'$."{key}"'
            out.append((name, "coalesce(json_extract_string(labels, $ARG), '(none)')", path))
        elif name in COST_DIMENSIONS:
            out.append((name, COST_DIMENSIONS[name], None))
        else:
            raise InvalidRequest.field(
                "by",
                f"must be one of {', '.join(COST_DIMENSIONS)} or label:KEY "
                f"(several separated by commas), not {name!r}",
            )
    return out


COST_COLUMNS = [
    "key",
    "runs",
    "charged_micros",
    "model_micros",
    "web_micros",
    "compute_micros",
    "input_tokens",
    "output_tokens",
]
TOTAL_COLUMNS = [
    "runs",
    "model_calls",
    "input_tokens",
    "output_tokens",
    "reserved_micros",
    "charged_micros",
    "refunded_micros",
    "model_micros",
    "web_micros",
    "compute_micros",
]


def _transient(err: duckdb.Error) -> bool:
    return isinstance(err, duckdb.IOException) or any(t in str(err) for t in _TRANSIENT)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


_SINCE_RE = re.compile(r"^(\d{1,6})([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(text: str | None) -> timedelta | None:
    """``30d``, ``12h``, ``2w``, ``90m``, ``45s``; ``all`` (or nothing) means no lower bound."""
    if text is None or text.strip().lower() == "all":
        return None
    match = _SINCE_RE.match(text.strip())
    if not match or int(match.group(1)) == 0:
        raise InvalidRequest.field(
            "since", f"expected a positive duration like 30d, 12h, 2w or 'all', not {text!r}"
        )
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})


class Records:
    """The recorded runs under one records directory (``settings.records_dir``)."""

    def __init__(self, records_dir: Path) -> None:
        self.records_dir = Path(records_dir)
        # Switched on, for this object's lifetime, the first time files of an older schema
        # (lacking a column) are met; compaction rewrites them and makes it unnecessary again.
        self._union_by_name = False
        # query/costs/totals share one restricted in-memory database (a new one costs 50-120 ms
        # on a busy 2-core box); each call gets its own cursor. User SQL is limited to one
        # read-only statement, so no call can change what the next one sees.
        self._db: duckdb.DuckDBPyConnection | None = None
        self._db_key: tuple[int, bool, Path] | None = None
        self._db_lock = threading.Lock()

    def connect(self, *, restricted: bool = False) -> duckdb.DuckDBPyConnection:
        """A new in-memory DuckDB connection with the views ``runs``, ``steps``, ``events``.

        The views list the files again on every query, so a long-lived connection sees new runs
        and survives compaction. ``restricted`` confines file access to the records (for SQL
        typed by a user): no reading or writing elsewhere, settings locked.
        """
        con = duckdb.connect(":memory:")
        try:
            con.execute("SET TimeZone = 'UTC'")
            self._create_views(con)
            if restricted:
                allowed = [f"{self.records_dir.resolve()}/", f"{schema_root()}/"]
                con.execute("SET allowed_directories = $1", [allowed])
                con.execute("SET enable_external_access = false")
                con.execute("SET lock_configuration = true")
        except duckdb.Error as err:
            con.close()
            raise EphemeralError(f"cannot open the records: {_first_line(err)}", cause=err) from err
        except BaseException:
            con.close()
            raise
        return con

    def close(self) -> None:
        with self._db_lock:
            if self._db is not None:
                self._db.close()
            self._db, self._db_key = None, None

    def _create_views(self, con: duckdb.DuckDBPyConnection) -> None:
        # Creating a view binds it, which lists the files; a compaction retiring one of them at
        # that moment is retried with a fresh listing.
        for kind in KINDS:
            for attempt in range(_ATTEMPTS):
                try:
                    with compaction.reading(self.records_dir):
                        con.execute(
                            view_sql(self.records_dir, kind, union_by_name=self._union_by_name)
                        )
                    break
                except duckdb.Error as err:
                    if attempt + 1 == _ATTEMPTS or not _transient(err):
                        raise

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        key = (os.getpid(), self._union_by_name, schema_root())
        with self._db_lock:
            if self._db is None or self._db_key != key:
                if self._db is not None:
                    self._db.close()
                self._db = self.connect(restricted=True)
                self._db_key = key
            return self._db.cursor()

    def _run(
        self, sql: str | duckdb.Statement, params: list[Any] | None = None
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        for attempt in range(_ATTEMPTS):
            cur = self._cursor()
            try:
                with compaction.reading(self.records_dir):
                    result = cur.execute(sql, params or [])
                    if result.description is None:
                        return [], []
                    return [d[0] for d in result.description], result.fetchall()
            except duckdb.PermissionException as err:
                raise InvalidRequest.field(
                    "sql", f"only the records can be read here ({_first_line(err)})"
                ) from err
            except duckdb.Error as err:
                if _SCHEMA_MISMATCH in str(err) and not self._union_by_name:
                    self._union_by_name = True
                    continue
                if attempt + 1 == _ATTEMPTS or not _transient(err):
                    raise InvalidRequest.field("sql", _first_line(err)) from err
            finally:
                cur.close()
        raise EphemeralError("unreachable: query attempts exhausted")

    def query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read-only statement over the views; returns (column names, rows).

        SELECT (also WITH, FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE) and EXPLAIN are allowed;
        anything else, bad SQL, or reading outside the records is an InvalidRequest on ``sql``.
        """
        if not sql or not sql.strip():
            raise InvalidRequest.field("sql", "is empty")
        try:
            statements = duckdb.extract_statements(sql)
        except duckdb.Error as err:
            raise InvalidRequest.field("sql", _first_line(err)) from err
        if len(statements) != 1:
            raise InvalidRequest.field("sql", f"expected one statement, got {len(statements)}")
        kind = statements[0].type
        if kind not in _READ_ONLY:
            raise InvalidRequest.field(
                "sql", f"only read-only statements (SELECT, EXPLAIN) are allowed, not {kind.name}"
            )
        return self._run(statements[0])

    def select(self, sql: str, params: list[Any]) -> tuple[list[str], list[tuple[Any, ...]]]:
        """A query of our own (not a caller's SQL: see :meth:`query`), with bound parameters."""
        return self._run(sql, params)

    def costs(
        self,
        by: str | Sequence[str],
        since: timedelta | None,
        *,
        now: datetime | None = None,
        org_id: str | None = None,
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Spend grouped by one or more dimensions (:func:`cost_dimensions`); money in micros,
        most expensive first (by day: days in order).

        One dimension: the group is the column ``key``, as always; several: one column each,
        named as asked (``model``, ``recipe``, ``label:team``). ``org_id`` limits it to one
        org's runs (the HTTP API always passes the caller's).
        """
        dims = cost_dimensions(by)
        where, params = self._since(since, now)
        if org_id is not None:
            params.append(org_id)
            where += (" AND " if where else "WHERE ") + f"org_id = ${len(params)}"
        selects = []
        for name, expr, arg in dims:
            if arg is not None:
                params.append(arg)
                expr = expr.replace("$ARG", f"${len(params)}")
            selects.append(f'{expr} AS "{"key" if len(dims) == 1 else name}"')
        groups = ", ".join(str(i + 1) for i in range(len(dims)))
        keys = ", ".join(f"{i + 1}" for i in range(len(dims)))
        order = keys if [d[0] for d in dims] == ["day"] else f"charged_micros DESC, {keys}"
        sql = (
            f"SELECT {', '.join(selects)}, count(*) AS runs, "
            "sum(charged_micros)::BIGINT AS charged_micros, "
            "sum(model_micros)::BIGINT AS model_micros, sum(web_micros)::BIGINT AS web_micros, "
            "sum(compute_micros)::BIGINT AS compute_micros, "
            "sum(input_tokens)::BIGINT AS input_tokens, "
            "sum(output_tokens)::BIGINT AS output_tokens "
            f"FROM runs {where} GROUP BY {groups} ORDER BY {order}"
        )
        return self._run(sql, params)

    def totals(self, since: timedelta | None, *, now: datetime | None = None) -> dict[str, int]:
        where, params = self._since(since, now)
        sums = ", ".join(
            f"coalesce(sum({c}), 0)::BIGINT AS {c}" for c in TOTAL_COLUMNS if c != "runs"
        )
        _, rows = self._run(f"SELECT count(*) AS runs, {sums} FROM runs {where}", params)
        return dict(zip(TOTAL_COLUMNS, rows[0], strict=True))

    @staticmethod
    def _since(since: timedelta | None, now: datetime | None) -> tuple[str, list[Any]]:
        if since is None:
            return "", []
        if since <= timedelta(0):
            raise InvalidRequest.field("since", "must be a positive duration")
        cutoff = (now or utcnow()).astimezone(UTC) - since
        # The date predicate lets DuckDB skip whole partitions before opening their files.
        return 'WHERE "date" >= $1 AND created_at >= $2', [cutoff.date(), cutoff]

    def compact(self, older_than_days: int = 1, *, now: datetime | None = None) -> int:
        """Merge per-run files of partitions at least N days old; returns files merged."""
        return compaction.compact(self.records_dir, older_than_days, now=now)

    def purge_content(self, retention_days: int = 30, now: datetime | None = None) -> int:
        """Null content older than N days (billing stays); returns records purged."""
        return retention.purge_content(self.records_dir, retention_days, now=now)
