"""Compaction: same answers before and after, re-runnable, and every run seen exactly once."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from ephemeral.errors import InvalidRequest
from ephemeral.records import Records, write_run
from ephemeral.records.compaction import MERGING_SUFFIX, reading
from tests.patience import PATIENCE
from tests.records.helpers import NOW, make_run

SUMMARY = (
    "SELECT count(*), count(DISTINCT run_id), sum(charged_micros), sum(model_micros), "
    "sum(web_micros), sum(compute_micros), sum(input_tokens), sum(output_tokens) FROM runs"
)
STEPS = "SELECT count(*), count(DISTINCT (run_id, seq)), sum(cost_micros) FROM steps"
EVENTS = "SELECT count(*), count(DISTINCT (run_id, seq)) FROM events"


def _snapshot(records: Records) -> tuple[object, ...]:
    return tuple(records.query(q)[1][0] for q in (SUMMARY, STEPS, EVENTS))


def _populate(root: Path, days: tuple[float, ...]) -> list[str]:
    ids = []
    for i, d in enumerate(days):
        run, steps, events = make_run(
            days_ago=d, steps=1 + i % 3, charged_micros=1000 + i, host=f"h{i % 2}"
        )
        write_run(root, run, steps, events)
        ids.append(run.run_id)
    return ids


def _partition(root: Path, kind: str, days_ago: int, host: str) -> Path:
    from datetime import timedelta

    return root / f"v1/kind={kind}/date={(NOW - timedelta(days=days_ago)).date()}/host={host}"


def test_compaction_keeps_totals_and_is_rerunnable(tmp_path: Path) -> None:
    _populate(tmp_path, (0, 0, 1, 2, 2, 2, 5, 5, 30))
    records = Records(tmp_path)
    before = _snapshot(records)
    merged = records.compact(older_than_days=1, now=NOW)
    assert merged == 7 * 3  # seven runs dated yesterday or earlier, three kinds each
    assert _snapshot(records) == before
    assert records.compact(older_than_days=1, now=NOW) == 0
    assert _snapshot(records) == before
    fresh = sorted(p.parent.parent.name for p in tmp_path.rglob("run_*.parquet"))
    assert fresh == [f"date={NOW.date()}"] * 6  # today's two runs, three kinds
    compacted = list(tmp_path.rglob("compacted.parquet"))
    assert {p.parent.parent.parent.name for p in compacted} == {
        "kind=runs",
        "kind=steps",
        "kind=events",
    }
    assert not [p for p in tmp_path.rglob(".*") if p.name not in (".compact.lock", ".readers.lock")]
    assert records.compact(older_than_days=0, now=NOW) == 6
    assert _snapshot(records) == before


def test_compacting_into_an_existing_compacted_file_merges(tmp_path: Path) -> None:
    _populate(tmp_path, (3, 3))
    records = Records(tmp_path)
    records.compact(now=NOW)
    _populate(tmp_path, (3, 3, 3))  # late arrivals in an already compacted partition
    before = _snapshot(records)
    assert before[0][0] == 5
    assert records.compact(now=NOW) == 9
    assert _snapshot(records) == before


def test_rewrite_after_compaction_wins_and_is_merged_next_time(tmp_path: Path) -> None:
    run, steps, events = make_run(days_ago=4, steps=3)
    write_run(tmp_path, run, steps, events)
    records = Records(tmp_path)
    records.compact(now=NOW)
    write_run(tmp_path, run.model_copy(update={"charged_micros": 7}), steps[:1], events)
    assert records.query("SELECT charged_micros FROM runs")[1] == [(7,)]
    assert records.query("SELECT count(*) FROM steps")[1] == [(1,)]
    assert records.compact(now=NOW) == 3
    assert records.query("SELECT charged_micros FROM runs")[1] == [(7,)]
    assert records.query("SELECT count(*) FROM steps")[1] == [(1,)]


def test_every_intermediate_state_shows_each_run_once(tmp_path: Path) -> None:
    """Replays the states a reader can meet while a compactor works on a partition."""
    ids = _populate(tmp_path, (2, 2, 2, 2))
    records = Records(tmp_path)
    expected = _snapshot(records)
    part = _partition(tmp_path, "runs", 2, "h0")
    saved = {p.name: p.read_bytes() for p in part.glob("run_*.parquet")}
    records.compact(now=NOW)

    # state after the compacted file is swapped in, before any fresh file is retired
    for name, data in saved.items():
        (part / name).write_bytes(data)
    assert _snapshot(records) == expected
    # mid-retirement: one fresh file renamed away, the other still listed
    first = sorted(saved)[0]
    os.rename(part / first, part / f".{first}{MERGING_SUFFIX}")
    assert _snapshot(records) == expected
    # a compactor that died there: the next run restores and re-merges, answers unchanged
    assert records.compact(now=NOW) == len(saved) and _snapshot(records) == expected
    assert not list(part.glob(f"*{MERGING_SUFFIX}"))
    assert set(ids) == {r[0] for r in records.query("SELECT run_id FROM runs")[1]}


def test_a_write_racing_the_compactor_is_not_lost(tmp_path: Path) -> None:
    from ephemeral.records import compaction

    run, steps, events = make_run(days_ago=2)
    write_run(tmp_path, run, steps, events)
    newer = run.model_copy(update={"charged_micros": 42})
    real_retire = compaction._retire

    def retire_after_rewrite(path: Path, read: os.stat_result) -> bool:
        # the settle task rewrites the run after the compactor read it, before it is retired
        if path.parent.parent.parent.name == "kind=runs":
            write_run(tmp_path, newer, steps, events)
        return real_retire(path, read)

    compaction._retire = retire_after_rewrite  # type: ignore[assignment]
    try:
        Records(tmp_path).compact(now=NOW)
    finally:
        compaction._retire = real_retire  # type: ignore[assignment]
    records = Records(tmp_path)
    assert records.query("SELECT charged_micros FROM runs")[1] == [(42,)]
    assert records.compact(now=NOW) >= 1
    assert records.query("SELECT charged_micros FROM runs")[1] == [(42,)]


@pytest.mark.slow
def test_concurrent_reader_never_sees_a_run_twice_or_not_at_all(tmp_path: Path) -> None:
    runs = [make_run(days_ago=3, steps=2, host="h1") for _ in range(30)]
    for run, steps, events in runs:
        write_run(tmp_path, run, steps, events)
    records = Records(tmp_path)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        # settle retries rewrite old runs while compaction keeps folding them away
        i = 0
        try:
            while not stop.is_set():
                run, steps, events = runs[i % len(runs)]
                write_run(tmp_path, run.model_copy(update={"charged_micros": i}), steps, events)
                if i % 5 == 0:
                    records.compact(now=NOW)
                i += 1
        except BaseException as err:
            errors.append(err)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        for _ in range(25):
            _, rows = records.query(
                "SELECT (SELECT count(*) FROM runs), (SELECT count(DISTINCT run_id) FROM runs), "
                "(SELECT count(*) FROM steps)"
            )
            assert rows == [(30, 30, 60)]
    finally:
        stop.set()
        worker.join()
    assert errors == []


def test_a_query_in_progress_holds_back_the_retiring_of_the_files_it_listed(
    tmp_path: Path,
) -> None:
    run, steps, events = make_run(days_ago=3, steps=2, host="h1")
    write_run(tmp_path, run, steps, events)
    fresh = _partition(tmp_path, "runs", 3, "h1") / f"{run.run_id}.parquet"
    merged: list[int] = []
    with reading(tmp_path):
        compactor = threading.Thread(
            target=lambda: merged.append(Records(tmp_path).compact(now=NOW))
        )
        compactor.start()
        # the compactor gets as far as the new compacted file, then waits for this reader
        compacted = fresh.with_name("compacted.parquet")
        deadline = time.monotonic() + PATIENCE
        while not compacted.exists():
            assert time.monotonic() < deadline, "the compactor never wrote a compacted file"
            compactor.join(0.01)
        assert fresh.exists()
        assert merged == []
    compactor.join(60)
    assert merged == [3]
    assert not fresh.exists()
    assert Records(tmp_path).query("SELECT count(*) FROM steps")[1] == [(2,)]


def test_compact_validates_and_skips_foreign_entries(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest) as err:
        Records(tmp_path).compact(older_than_days=-1)
    assert err.value.errors == [{"field": "older_than_days", "message": "must be 0 or more"}]
    _populate(tmp_path, (2,))
    (tmp_path / "v1/kind=runs/not-a-date").mkdir()
    (tmp_path / "v1/kind=runs/README").write_text("hi")
    assert Records(tmp_path).compact(now=NOW) == 3
    shutil.rmtree(tmp_path / "v1/kind=runs/not-a-date")
