"""The cost report: a self-contained HTML page (inline CSS and SVG, no external assets)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import jinja2

from ephemeral.ids import rfc3339, utcnow
from ephemeral.money.amounts import usd as _money_usd
from ephemeral.records.reader import Records

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"


def usd(micros: int | None) -> str:
    """:func:`ephemeral.money.amounts.usd`, where a sum over no rows (NULL) is $0.00."""
    return _money_usd(micros or 0)


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    day: str
    label: str


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    bars: list[Bar]
    max_label: str
    x_labels: list[tuple[float, str]]
    baseline: float


def _days(rows: list[tuple[Any, ...]], since: timedelta | None, now: datetime) -> list[date]:
    seen = sorted(date.fromisoformat(r[0]) for r in rows)
    today = now.astimezone(UTC).date()
    first = (now.astimezone(UTC) - since).date() if since else (seen[0] if seen else today)
    last = max(today, seen[-1]) if seen else today
    if (last - first).days > 366:  # keep the chart readable for "since all time"
        first = last - timedelta(days=366)
    return [first + timedelta(days=i) for i in range((last - first).days + 1)]


def cost_chart(rows: list[tuple[Any, ...]], since: timedelta | None, now: datetime) -> Chart:
    """Bars of charged spend per day (UTC), days without runs included as zero."""
    charged = {r[0]: int(r[2] or 0) for r in rows}
    days = _days(rows, since, now)
    width, height, left, bottom, top = 720, 220, 70, 30, 12
    plot_w, plot_h = width - left - 10, height - bottom - top
    peak = max([*charged.values(), 1])
    step = plot_w / max(len(days), 1)
    bars = []
    for i, day in enumerate(days):
        value = charged.get(day.isoformat(), 0)
        h = plot_h * value / peak
        bars.append(
            Bar(
                x=round(left + i * step + step * 0.1, 2),
                y=round(top + plot_h - h, 2),
                width=round(max(step * 0.8, 0.5), 2),
                height=round(h, 2),
                day=day.isoformat(),
                label=usd(value),
            )
        )
    every = max(1, len(days) // 6)
    x_labels = [
        (round(left + i * step + step / 2, 2), d.strftime("%m-%d"))
        for i, d in enumerate(days)
        if i % every == 0
    ]
    return Chart(width, height, bars, usd(peak if charged else 0), x_labels, top + plot_h)


def _with_usd(columns: list[str], rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        item = dict(zip(columns, row, strict=True))
        for col in columns:
            if col.endswith("_micros"):
                item[col.removesuffix("_micros") + "_usd"] = usd(item[col])
        out.append(item)
    return out


def describe_period(since: timedelta | None, now: datetime) -> str:
    if since is None:
        return "all time"
    start = rfc3339(now - since)
    if since % timedelta(days=1) == timedelta(0):
        return f"last {since.days} days (since {start})"
    return f"last {since.total_seconds() / 3600:g} hours (since {start})"


def grouped(records: Records, by: str, since: timedelta | None, now: datetime) -> dict[str, Any]:
    """Spend by the dimensions asked for (``model,recipe,label:team``): one table, a column
    per dimension."""
    cols, rows = records.costs(by, since, now=now)
    dims = cols[: cols.index("runs")]
    return {"by": by, "dims": dims, "rows": _with_usd(cols, rows)}


def report_context(
    records: Records,
    since: timedelta | None,
    *,
    now: datetime | None = None,
    by: str | None = None,
) -> dict[str, Any]:
    now = now or utcnow()
    totals = records.totals(since, now=now)
    parts = [(name, totals[f"{name}_micros"]) for name in ("model", "web", "compute")]
    spent = sum(v for _, v in parts)
    breakdown = [
        {
            "part": name,
            "micros": v,
            "usd": usd(v),
            "share": f"{(100 * v / spent):.1f}%" if spent else "-",
        }
        for name, v in parts
    ]
    by_dim = {}
    for dim in ("model", "recipe", "status"):
        cols, rows = records.costs(dim, since, now=now)
        by_dim[dim] = _with_usd(cols, rows)
    _, day_rows = records.costs("day", since, now=now)
    return {
        "generated_at": rfc3339(now),
        "period": describe_period(since, now),
        "totals": {
            **totals,
            **{
                k.removesuffix("_micros") + "_usd": usd(v)
                for k, v in totals.items()
                if k.endswith("_micros")
            },
        },
        "breakdown": breakdown,
        "by": by_dim,
        "chart": cost_chart(day_rows, since, now),
        "grouped": grouped(records, by, since, now) if by else None,
    }


def render_costs_html(
    records: Records,
    since: timedelta | None,
    *,
    now: datetime | None = None,
    by: str | None = None,
) -> str:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    return env.get_template("report_costs.html.j2").render(
        **report_context(records, since, now=now, by=by)
    )
