"""Cost roll-ups by every dimension, windows, and the HTML report."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest

from ephemeral.errors import InvalidRequest
from ephemeral.records import COST_COLUMNS, COST_DIMENSIONS, Records, write_run
from ephemeral.records.report import render_costs_html, usd
from tests.records.helpers import NOW, make_run

# (days ago, model, recipe, org, status, charged, model part, web part, compute part)
RUNS = [
    (0, "openai/a", "proof", "org_a", "succeeded", 3530, 3000, 30, 500),
    (0, "openai/a", None, "org_b", "failed", 1000, 900, 0, 100),
    (1, "anthropic/b", "proof", "org_a", "succeeded", 20000, 19000, 0, 1000),
    (3, "openai/a", "lint", "org_a", "budget_exhausted", 40000, 39000, 500, 500),
    (45, "anthropic/b", "lint", "org_b", "succeeded", 7, 5, 1, 1),
]


@pytest.fixture
def records(tmp_path: Path) -> Records:
    for days, model, recipe, org, status, charged, m, w, c in RUNS:
        write_run(
            tmp_path,
            *make_run(
                days_ago=days,
                model=model,
                recipe=recipe,
                org_id=org,
                status=status,
                charged_micros=charged,
                model_micros=m,
                web_micros=w,
                compute_micros=c,
                input_tokens=100,
                output_tokens=10,
            ),
        )
    records = Records(tmp_path)
    records.compact(older_than_days=2, now=NOW)  # answers must not depend on the file layout
    return records


def _expected(by: str, since_days: int | None) -> dict[str, tuple[int, ...]]:
    out: dict[str, list[int]] = {}
    for days, model, recipe, org, status, charged, m, w, c in RUNS:
        if since_days is not None and days >= since_days:
            continue
        key = {
            "model": model,
            "recipe": recipe or "(none)",
            "org": org,
            "status": status,
            "day": (NOW - timedelta(days=days)).date().isoformat(),
            "kind": "run",  # every recorded run here is a run (sessions: tests/sessions)
        }[by]
        acc = out.setdefault(key, [0] * 7)
        for i, v in enumerate((1, charged, m, w, c, 100, 10)):
            acc[i] += v
    return {k: tuple(v) for k, v in out.items()}


@pytest.mark.parametrize("by", sorted(COST_DIMENSIONS))
@pytest.mark.parametrize("since_days", [30, None])
def test_costs_by_each_dimension(records: Records, by: str, since_days: int | None) -> None:
    since = timedelta(days=since_days) if since_days else None
    columns, rows = records.costs(by, since, now=NOW)
    assert columns == COST_COLUMNS
    assert {r[0]: tuple(r[1:]) for r in rows} == _expected(by, since_days)
    if by == "day":
        assert [r[0] for r in rows] == sorted(r[0] for r in rows)
    else:
        assert [r[2] for r in rows] == sorted((r[2] for r in rows), reverse=True)


def test_bad_dimension_and_window_name_the_field(records: Records) -> None:
    with pytest.raises(InvalidRequest) as err:
        records.costs("colour", None)
    assert err.value.errors is not None and err.value.errors[0]["field"] == "by"
    assert "colour" in err.value.detail
    with pytest.raises(InvalidRequest) as err:
        records.costs("model", timedelta(0))
    assert err.value.errors is not None and err.value.errors[0]["field"] == "since"


def test_totals(records: Records) -> None:
    totals = records.totals(timedelta(days=30), now=NOW)
    assert totals["runs"] == 4
    assert totals["charged_micros"] == 3530 + 1000 + 20000 + 40000
    assert totals["web_micros"] == 530
    assert records.totals(None)["runs"] == 5


@pytest.mark.parametrize(
    ("micros", "text"),
    [
        (3530, "$0.00353"),
        (0, "$0.00"),
        (1_234_567_891, "$1234.567891"),
        (5, "$0.000005"),
        (-3530, "-$0.00353"),
        (None, "$0.00"),  # a sum over no rows
    ],
)
def test_usd(micros: int | None, text: str) -> None:
    assert usd(micros) == text


def test_html_report_is_self_contained_and_has_the_totals(records: Records) -> None:
    page = render_costs_html(records, timedelta(days=30), now=NOW)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page.lower() and "<link" not in page.lower()
    assert re.search(r'id="total-charged">\$0\.06453<', page)  # 64530 micros
    assert re.search(r'id="total-runs">4<', page)
    assert page.count('<rect class="bar"') == 31  # one bar per day of the window
    for section in ("breakdown", "by-model", "by-recipe", "chart"):
        assert f'id="{section}"' in page
    assert "openai/a" in page and "anthropic/b" in page and "(none)" in page


def test_html_report_escapes_recorded_names(tmp_path: Path) -> None:
    write_run(tmp_path, *make_run(recipe="<img src=x onerror=alert(1)>"))
    page = render_costs_html(Records(tmp_path), None, now=NOW)
    assert "<img" not in page and "&lt;img src=x" in page
