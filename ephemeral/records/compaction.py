"""Compaction: fold a partition's per-run files into one zstd ``compacted.parquet``.

Querying thousands of small files costs ~0.4 ms a file per query; one file per (kind, date,
host) brings an aggregate back to tens of milliseconds.

How a concurrent reader sees every run exactly once
----------------------------------------------------
Readers follow one rule (``views.py``): a run comes from its fresh file ``<run_id>.parquet``
when one is listed, else from ``compacted.parquet``. The compactor, holding the partition's
lock (compactors and the purge only; writers never lock), does:

1. list the fresh files and ``stat`` each (before reading it, so a later write is noticed);
2. write fresh rows + the old compacted rows of runs without a fresh file to a temp file and
   ``os.replace`` it over ``compacted.parquet`` (one atomic swap, old or new, never both);
3. retire each fresh file: rename it to a hidden ``.<name>.merging`` (gone from the glob in one
   step), and if its inode is not the one read in 1 (a writer rewrote the run meanwhile) link
   it back, because that newer version is not in the compacted file; then unlink the trash.

At every instant a run is in a listed fresh file (shown from there, hidden in compacted) or,
from step 2 on, in ``compacted.parquet`` (shown from there). The view lists the fresh files
once (a materialized CTE), before it opens the compacted file, so it cannot pair the old
compacted file with a listing taken after step 3. A reader that listed a fresh file which step 3
then removed gets an I/O error, not a wrong answer; ``Records.query`` lists again and retries.
A crash between 2 and 3 leaves fresh files that are also compacted: still shown once, and
merged again next time. A crash inside 3 leaves ``.merging`` files, restored on the next run.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb

from ephemeral import flock
from ephemeral.errors import InvalidRequest
from ephemeral.ids import utcnow
from ephemeral.records.schema import (
    COMPACTED_NAME,
    FRESH_GLOB,
    KINDS,
    SCHEMA_VERSION,
    kind_dir,
    parse_partition_date,
)
from ephemeral.records.views import schema_files, typed_select
from ephemeral.records.writer import _cursor, fsync_file, sql_str, temp_name

LOCK_NAME = ".compact.lock"
READERS_LOCK = ".readers.lock"
MERGING_SUFFIX = ".merging"
# A writer's temp file lives for milliseconds; one this old belongs to a crashed process.
STALE_TEMP_SECONDS = 3600


def partitions(
    records_dir: Path, until: date | None, kinds: tuple[str, ...] = KINDS
) -> Iterator[tuple[str, date, Path]]:
    """(kind, date, directory) of every partition dated ``until`` or earlier, oldest first."""
    for kind in kinds:
        base = kind_dir(records_dir, kind)
        if not base.is_dir():
            continue
        for day_dir in sorted(base.iterdir()):
            day = parse_partition_date(day_dir.name)
            if day is None or (until is not None and day > until) or not day_dir.is_dir():
                continue
            for host_dir in sorted(day_dir.iterdir()):
                if host_dir.name.startswith("host=") and host_dir.is_dir():
                    yield kind, day, host_dir


@contextmanager
def partition_lock(directory: Path) -> Iterator[bool]:
    """Exclusive lock among compactors and the purge; yields False if another holds it."""
    with flock.held(directory / LOCK_NAME, wait=False) as got:
        yield got


def _readers_lock(root: Path) -> int | None:
    """An fd for ``<root>/.readers.lock`` (root is ``<records_dir>/v1``); None if unavailable.

    Made if missing; opened read-only on a root this process may not write (flock works on any
    open fd); None when the root does not exist.
    """
    path = root / READERS_LOCK
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except FileNotFoundError:
        return None
    except PermissionError:
        try:
            return os.open(path, os.O_RDONLY)
        except OSError:
            return None


@contextmanager
def reading(records_dir: Path) -> Iterator[None]:
    """Shared lock held while a query lists and opens files: retiring them waits for it.

    Without it a query under a busy compactor could lose every retry to the race (a file listed,
    then retired before it was opened). A records root the reader cannot lock (no ``v1`` yet,
    a read-only mount) is read unlocked: nothing can be retiring files the reader may not see.
    """
    fd = _readers_lock(records_dir / f"v{SCHEMA_VERSION}")
    if fd is None:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@contextmanager
def _retiring(partition: Path) -> Iterator[None]:
    # partition is <root>/v1/kind=K/date=D/host=H; the readers lock lives in <root>/v1
    fd = _readers_lock(partition.parents[2])
    if fd is None:
        raise OSError(f"cannot open the readers lock under {partition.parents[2]}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def order_by(kind: str) -> str:
    return "run_id" if kind == "runs" else "run_id, seq"


def _recover(directory: Path) -> None:
    for trash in directory.glob(f".*{MERGING_SUFFIX}"):
        original = directory / trash.name[1 : -len(MERGING_SUFFIX)]
        # Restoring is always safe (fresh wins over compacted) unless a newer write took the name.
        with suppress(FileExistsError):
            os.link(trash, original)
        trash.unlink(missing_ok=True)
    cutoff = time.time() - STALE_TEMP_SECONDS
    for tmp in directory.glob(".*.tmp"):
        try:
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
        except FileNotFoundError:
            continue


def _retire(path: Path, read: os.stat_result) -> bool:
    """Remove a merged fresh file unless a writer replaced it after it was read."""
    trash = path.with_name(f".{path.name}{MERGING_SUFFIX}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return False
    now = os.stat(trash)
    merged = (now.st_dev, now.st_ino) == (read.st_dev, read.st_ino)
    if not merged:
        with suppress(FileExistsError):  # an even newer write is already in place
            os.link(trash, path)
    trash.unlink()
    return merged


def rewrite_compacted(
    cur: duckdb.DuckDBPyConnection,
    kind: str,
    directory: Path,
    select_sql: str,
    params: list[Any] | None = None,
) -> None:
    """Atomically replace the partition's compacted file with the rows of ``select_sql``."""
    target = directory / COMPACTED_NAME
    tmp = temp_name(target)
    try:
        cur.execute(
            f"COPY ({select_sql} ORDER BY {order_by(kind)}) TO {sql_str(tmp)} "
            "(FORMAT parquet, COMPRESSION zstd)",
            params or [],
        )
        fsync_file(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def read_files(kind: str, files: list[Path]) -> str:
    """Typed physical columns of ``files`` (the schema file supplies any column they lack)."""
    paths = ", ".join(sql_str(p) for p in [schema_files()[kind], *files])
    return (
        f"SELECT {typed_select(kind, logical=False)} FROM read_parquet([{paths}], "
        "hive_partitioning=false, union_by_name=true)"
    )


def compact_locked(kind: str, directory: Path) -> int:
    """Compaction of one partition; the caller holds :func:`partition_lock`."""
    _recover(directory)
    read: dict[Path, os.stat_result] = {}
    for path in sorted(directory.glob(FRESH_GLOB)):
        try:
            read[path] = os.stat(path)
        except FileNotFoundError:
            continue
    if not read:
        return 0
    fresh_sql = read_files(kind, list(read))
    compacted = directory / COMPACTED_NAME
    select = f"WITH fresh AS MATERIALIZED ({fresh_sql}) SELECT * FROM fresh"
    if compacted.exists():
        select += (
            f" UNION ALL SELECT c.* FROM ({read_files(kind, [compacted])}) AS c "
            "ANTI JOIN fresh AS f ON c.run_id = f.run_id"
        )
    cur = _cursor()
    try:
        rewrite_compacted(cur, kind, directory, select)
    finally:
        cur.close()
    with _retiring(directory):
        return sum(_retire(path, st) for path, st in read.items())


def compact_partition(kind: str, directory: Path) -> int:
    with partition_lock(directory) as locked:
        return compact_locked(kind, directory) if locked else 0


def compact(records_dir: Path, older_than_days: int = 1, *, now: datetime | None = None) -> int:
    """Compact every partition dated at least ``older_than_days`` before today (UTC)."""
    if older_than_days < 0:
        raise InvalidRequest.field("older_than_days", "must be 0 or more")
    last = (now or utcnow()).astimezone(UTC).date() - timedelta(days=older_than_days)
    return sum(compact_partition(kind, d) for kind, _, d in partitions(records_dir, last))
