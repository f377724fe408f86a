"""What the pages show of a run, in the product page's words (shared by the run page, the live
stream and the sample replay so that the three cannot drift)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from markdown_it import MarkdownIt
from markupsafe import Markup

from ephemeral.events import Event
from ephemeral.lifecycle import TERMINAL_STATUSES
from ephemeral.money.amounts import usd
from ephemeral.recipes.checks import CheckResult
from ephemeral.timeline import COMMAND_EVENTS, describe

# The output is written by the model: raw HTML stays text ("html": False) and markdown-it's
# link validation refuses javascript:/vbscript:/data: links.
_md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False})
MAX_SHOWN_OUTPUT_CHARS = 64_000

STATUS_LABELS = {
    "queued": "Queued",
    "provisioning": "Provisioning",
    "running": "Running",
    "succeeded": "Succeeded",
    "failed": "Failed",
    "timed_out": "Timed out",
    "cancelled": "Cancelled",
    "budget_exhausted": "Budget exhausted",
}


def markdown(text: str | None) -> Markup:
    if not text:
        return Markup("")
    if len(text) > MAX_SHOWN_OUTPUT_CHARS:
        text = text[:MAX_SHOWN_OUTPUT_CHARS] + "\n\n… (cut for display)"
    return Markup(_md.render(text))


def parse_at(at: str) -> datetime:
    return datetime.fromisoformat(at.replace("Z", "+00:00"))


def timeline_row(ev: Event, t0: str | None = None) -> dict[str, Any]:
    """One row of the timeline: stage and text from :func:`describe`, plus the details."""
    stage, text = describe(ev)
    d = ev.data
    offset = (parse_at(ev.at) - parse_at(t0)).total_seconds() if t0 else 0.0
    row: dict[str, Any] = {
        "seq": ev.seq,
        "type": ev.type,
        "stage": stage,
        "text": text,
        "at": ev.at,
        "offset_ms": max(0, int(offset * 1000)),
        "kind": ev.type.split(".", 1)[0],
    }
    if ev.type in COMMAND_EVENTS:  # a session's exec, setup and verify read like a shell step
        row["command"] = d.get("command")
        row["timed_out"] = bool(d.get("timed_out"))
        row["skipped"] = d.get("skipped")  # verify.executed only: why it did not run
        row["stdout"] = d.get("stdout") or ""
        row["stderr"] = d.get("stderr") or ""
        row["exit_code"] = d.get("exit_code")
        row["duration_ms"] = d.get("duration_ms")
        row["user"] = d.get("user")  # sandbox.exec only; None for a run's shell step
    elif ev.type == "run.output":
        row["output_html"] = markdown(d.get("markdown"))
        row["erased"] = d.get("markdown") is None
    return row


def grading(labels: dict[str, Any], events: list[Event]) -> dict[str, Any]:
    """How the run was graded, for its page: the verdicts of its recipe's checks (stored in its
    labels when the evaluation judged it) and its verify commands' results (their events)."""
    checks = []
    for item in labels.get("checks") or []:
        try:
            checks.append(CheckResult.model_validate(item))
        except ValueError:
            continue  # not a verdict this version wrote: not shown rather than guessed
    verify = [e.data for e in events if e.type == "verify.executed"]
    passed = [v for v in verify if not v.get("skipped") and v.get("exit_code") == 0]
    return {
        "checks": checks,
        "checks_passed": sum(1 for c in checks if c.passed),
        "verify_count": len(verify),
        "verify_passed": len(passed),
    }


def permission_rows(policy: dict[str, Any], retention_days: int) -> list[tuple[str, str]]:
    """The product page's "What the agent can and cannot do" table, from the stored policy."""
    conns = policy.get("connections") or []
    files = policy.get("files") or []
    conn_text = (
        "; ".join(
            f"{c.get('name')}: {', '.join(c.get('methods') or [])} "
            f"{', '.join(c.get('paths') or [])}"
            for c in conns
        )
        or "none"
    )
    file_text = ", ".join(str(f.get("path")) for f in files) or "none"
    zdr = policy.get("zero_data_retention")
    return [
        ("Connections", conn_text),
        ("Web", web_text(policy.get("web"))),
        ("Shell", "on, inside a sealed machine" if policy.get("shell") else "off"),
        ("Files", file_text),
        (
            "Zero data retention",
            "on: no content is kept" if zdr else f"off: records are kept for {retention_days} days",
        ),
        ("Budget", f"{usd(policy.get('max_cost_micros'))}, hard cap"),
        ("Time limit", f"{policy.get('timeout_seconds')} seconds"),
        ("Isolation", str(policy.get("isolation", "auto"))),
        *_environment_rows(policy),
    ]


def _environment_rows(policy: dict[str, Any]) -> list[tuple[str, str]]:
    """The image and the setup/verify commands, when the run names them."""
    rows = []
    if policy.get("image"):
        rows.append(("Image", str(policy["image"])))
    setup, verify = policy.get("setup") or [], policy.get("verify") or []
    if setup or verify:
        rows.append(("Setup / verify", f"{len(setup)} / {len(verify)} commands"))
    return rows


def web_text(web: object) -> str:
    """``web`` for the permissions table: off, on, or on for the allow list's hosts only."""
    if isinstance(web, dict):
        return "on, only to " + ", ".join(str(h) for h in web.get("allow") or [])
    return "on" if web else "off"


def money_line(run: dict[str, Any]) -> str | None:
    """``$0.00353 charged, $0.03647 refunded (model … · web … · compute …)`` once settled."""
    cost = run["cost"]
    if cost.get("charged_micros") is None or run["status"] not in TERMINAL_STATUSES:
        return None
    b = cost["breakdown"]
    return (
        f"{usd(cost['charged_micros'])} charged, {usd(cost['refunded_micros'])} refunded"
        f" (model {usd(b['model_micros'])} · web {usd(b['web_micros'])}"
        f" · compute {usd(b['compute_micros'])})"
    )


def headline(run: dict[str, Any]) -> str:
    """``Succeeded · run_… · $0.00353 of $0.04``."""
    cost = run["cost"]
    status = STATUS_LABELS.get(run["status"], run["status"])
    spent = cost.get("charged_micros") if money_line(run) else None
    money = (
        f"{usd(spent)} of {usd(cost['reserved_micros'])}"
        if spent is not None
        else (f"budget {usd(cost['reserved_micros'])}")
    )
    return f"{status} · {run['id']} · {money}"


def request_json(prompt: str, policy: dict[str, Any], model: str | None = None) -> dict[str, Any]:
    """The body a client sends for this prompt and policy, with only the fields that matter
    (the product page's request.json shape)."""
    body: dict[str, Any] = {"prompt": prompt}
    if model:
        body["model"] = model
    web = policy.get("web")
    body["web"] = web if isinstance(web, dict) else bool(web)
    body["shell"] = bool(policy.get("shell", True))
    for key in ("files", "connections"):
        if policy.get(key):
            body[key] = policy[key]
    if policy.get("zero_data_retention"):
        body["zero_data_retention"] = True
    body["timeout_seconds"] = policy.get("timeout_seconds", 120)
    body["max_cost_micros"] = policy.get("max_cost_micros", 40_000)
    if policy.get("isolation", "auto") != "auto":
        body["isolation"] = policy["isolation"]
    return body


CURL = """curl -X POST $EPHEMERAL_URL/v1/runs \\
  -H "Authorization: Bearer $EPHEMERAL_API_KEY" \\
  -H "Content-Type: application/json" \\
  -H "Idempotency-Key: $(python3 -c 'import uuid; print(uuid.uuid4())')" \\
  -d @request.json"""
