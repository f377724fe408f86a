"""Read side of the records: DuckDB connections with the views, SQL queries, cost roll-ups."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb

from ephemeral.errors import EphemeralError, InvalidRequest
from ephemeral.ids import utcnow
from ephemeral.records import compaction, retention
from ephemeral.records.schema import KINDS
from ephemeral.records.views import schema_root, view_sql

# A query can race a compaction or a rewrite: a file DuckDB listed a moment before is gone, or
# was replaced between two reads of it (DuckDB then fails on the footer). Those are errors, not
# wrong answers; the next attempt lists and opens the files again.
_ATTEMPTS = 5
_TRANSIENT = (
    "No such file or directory", "TProtocolException", "No magic bytes",
    "Could not read enough bytes",
)


def _transient(err: duckdb.Error) -> bool:
    return isinstance(err, duckdb.IOException) or any(t in str(err) for t in _TRANSIENT)

COST_DIMENSIONS: dict[str, str] = {
    "model": "model",
    "recipe": "coalesce(recipe, '(none)')",
    "day": "strftime(\"date\", '%Y-%m-%d')",
    "org": "org_id",
    "status": "status",
}
COST_COLUMNS = [
    "key", "runs", "charged_micros", "model_micros", "web_micros", "compute_micros",
    "input_tokens", "output_tokens",
]
TOTAL_COLUMNS = [
    "runs", "model_calls", "input_tokens", "output_tokens", "reserved_micros", "charged_micros",
    "refunded_micros", "model_micros", "web_micros", "compute_micros",
]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class Records:
    """The recorded runs under one records directory (``settings.records_dir``)."""

    def __init__(self, records_dir: Path) -> None:
        self.records_dir = Path(records_dir)

    def connect(self, *, restricted: bool = False) -> duckdb.DuckDBPyConnection:
        """A new in-memory DuckDB connection with the views ``runs``, ``steps``, ``events``.

        The views list the files again on every query, so a long-lived connection sees new runs
        and survives compaction. ``restricted`` confines file access to the records (for SQL
        typed by a user): no reading or writing elsewhere, settings locked.
        """
        con = duckdb.connect(":memory:")
        try:
            con.execute("SET TimeZone = 'UTC'")
            for kind in KINDS:
                self._create_view(con, kind)
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

    def _create_view(self, con: duckdb.DuckDBPyConnection, kind: str) -> None:
        # Creating a view binds it, which lists and opens the files; a compaction retiring one
        # of them at that moment is retried with a fresh listing.
        for attempt in range(_ATTEMPTS):
            try:
                con.execute(view_sql(self.records_dir, kind))
                return
            except duckdb.Error as err:
                if attempt + 1 == _ATTEMPTS or not _transient(err):
                    raise

    def _run(
        self, sql: str, params: list[Any] | None = None, *, restricted: bool
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        for attempt in range(_ATTEMPTS):
            con = self.connect(restricted=restricted)
            try:
                cur = con.execute(sql, params or [])
                if cur.description is None:
                    return [], []
                return [d[0] for d in cur.description], cur.fetchall()
            except duckdb.PermissionException as err:
                raise InvalidRequest.field(
                    "sql", f"only the records can be read here ({_first_line(err)})"
                ) from err
            except duckdb.Error as err:
                if attempt + 1 == _ATTEMPTS or not _transient(err):
                    raise InvalidRequest.field("sql", _first_line(err)) from err
            finally:
                con.close()
        raise EphemeralError("unreachable: query attempts exhausted")

    def query(self, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run SQL over the views; returns (column names, rows). Bad SQL -> InvalidRequest(sql)."""
        if not sql or not sql.strip():
            raise InvalidRequest.field("sql", "is empty")
        return self._run(sql, restricted=True)

    def costs(
        self, by: str, since: timedelta | None, *, now: datetime | None = None
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Spend grouped by one dimension; money in micros, most expensive first (days in order)."""
        key = COST_DIMENSIONS.get(by)
        if key is None:
            raise InvalidRequest.field(
                "by", f"must be one of {', '.join(COST_DIMENSIONS)}, not {by!r}"
            )
        where, params = self._since(since, now)
        order = "key" if by == "day" else "charged_micros DESC, key"
        sql = (
            f"SELECT {key} AS key, count(*) AS runs, "
            "sum(charged_micros)::BIGINT AS charged_micros, "
            "sum(model_micros)::BIGINT AS model_micros, sum(web_micros)::BIGINT AS web_micros, "
            "sum(compute_micros)::BIGINT AS compute_micros, "
            "sum(input_tokens)::BIGINT AS input_tokens, "
            "sum(output_tokens)::BIGINT AS output_tokens "
            f"FROM runs {where} GROUP BY 1 ORDER BY {order}"
        )
        return self._run(sql, params, restricted=False)

    def totals(self, since: timedelta | None, *, now: datetime | None = None) -> dict[str, int]:
        where, params = self._since(since, now)
        sums = ", ".join(
            f"coalesce(sum({c}), 0)::BIGINT AS {c}" for c in TOTAL_COLUMNS if c != "runs"
        )
        _, rows = self._run(
            f"SELECT count(*) AS runs, {sums} FROM runs {where}", params, restricted=False
        )
        return dict(zip(TOTAL_COLUMNS, rows[0], strict=True))

    @staticmethod
    def _since(since: timedelta | None, now: datetime | None) -> tuple[str, list[Any]]:
        if since is None:
            return "", []
        if since <= timedelta(0):
            raise InvalidRequest.field("since", "must be a positive duration")
        cutoff = (now or utcnow()).astimezone(UTC) - since
        # The date predicate lets DuckDB skip whole partitions before opening their files.
        return "WHERE \"date\" >= $1 AND created_at >= $2", [cutoff.date(), cutoff]

    def compact(self, older_than_days: int = 1, *, now: datetime | None = None) -> int:
        """Merge per-run files of partitions at least N days old; returns files merged."""
        return compaction.compact(self.records_dir, older_than_days, now=now)

    def purge_content(self, retention_days: int = 30, now: datetime | None = None) -> int:
        """Null content older than N days (billing stays); returns records purged."""
        return retention.purge_content(self.records_dir, retention_days, now=now)
