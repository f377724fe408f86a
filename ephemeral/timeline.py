"""One line per event, in the product page's words; shared by the CLI and the run page."""

from __future__ import annotations

from typing import Any

from ephemeral.events import Event
from ephemeral.money.amounts import usd


def _first_line(text: str | None, limit: int = 160) -> str:
    if not text:
        return ""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


# Commands shown with their exit code, duration and output: the agent's shell steps, a session's
# execs, and the grading around a run (its setup before the first turn, its verify after).
COMMAND_EVENTS = ("shell.executed", "sandbox.exec", "setup.executed", "verify.executed")


def command_text(d: dict[str, Any]) -> str:
    """``$ first line`` of a command (``… (+N lines)`` when it has more), or its size when its
    content was not kept (zero data retention)."""
    cmd = d.get("command")
    if cmd is None:
        return f"$ ({d.get('command_bytes', 0)} bytes)"
    lines = cmd.strip().splitlines() or [""]
    more = f" … (+{len(lines) - 1} lines)" if len(lines) > 1 else ""
    return f"$ {_first_line(cmd)}{more}"


def _graded(d: dict[str, Any]) -> str:
    """A setup or verify step: ``$ cmd → exit 0 · 412 ms``, or why it was skipped."""
    if d.get("skipped"):
        return f"{command_text(d)}  → skipped: {d['skipped']}"
    ending = " (timed out)" if d.get("timed_out") else ""
    duration = f" · {d['duration_ms']} ms" if d.get("duration_ms") is not None else ""
    truncated = " (truncated)" if d.get("truncated") else ""
    return f"{command_text(d)}  → exit {d.get('exit_code')}{ending}{duration}{truncated}"


def describe(event: Event | dict[str, Any]) -> tuple[str, str]:
    """(stage, text) for one event, e.g. ("Shell", "$ pwd; whoami")."""
    ev = event if isinstance(event, Event) else Event.model_validate(event)
    d = ev.data
    t = ev.type
    if t == "run.queued":
        return "Queued", f"budget {usd(d.get('reserved_micros'))} reserved"
    if t == "sandbox.ready":
        runtime = f" · {d['runtime']}" if d.get("runtime") else ""
        return "Sandbox", f"{d.get('isolation')} ready · {d.get('boot_ms')} ms{runtime}"
    if t == "worker.started":
        parts = [
            f"shell {'on' if d.get('shell') else 'off'}",
            f"web {'on' if d.get('web') else 'off'}"
            + (
                f" (only {', '.join(d['web'].get('allow') or [])})"
                if isinstance(d.get("web"), dict)
                else ""
            ),
        ]
        if d.get("connections"):
            parts.append("connections " + ", ".join(d["connections"]))
        if d.get("files"):
            parts.append(f"{len(d['files'])} file(s)")
        return "Sandbox", "worker started · " + " · ".join(parts)
    if t == "model.called":
        return "Model", (
            f"{d.get('model')} · {d.get('input_tokens', 0) + d.get('output_tokens', 0):,} tokens"
            f" · {usd(d.get('cost_micros'))} · {d.get('latency_ms')} ms"
        )
    if t == "shell.executed":
        cmd = d.get("command")
        text = (
            f"$ {_first_line(cmd)}" if cmd is not None else f"$ ({d.get('command_bytes', 0)} bytes)"
        )
        return "Shell", f"{text}  → exit {d.get('exit_code')}" + (
            " (truncated)" if d.get("truncated") else ""
        )
    if t == "setup.executed":
        return "Setup", _graded(d)
    if t == "verify.executed":
        return "Verify", _graded(d)
    if t == "agent.started":
        cmd = d.get("command")
        text = (
            f"$ {_first_line(cmd)}" if cmd is not None else f"$ ({d.get('command_bytes', 0)} bytes)"
        )
        models = ", ".join(d.get("models") or []) or "no model"
        return "Agent", f"{text} · in {d.get('image')} · models {models}"
    if t == "agent.exited":
        if d.get("killed"):
            ending = f"killed: {d.get('killed')}"
        elif d.get("timed_out"):
            ending = "killed at the time limit"
        else:
            ending = f"exit {d.get('exit_code')}"
        size = d.get("output_bytes")
        answer = f" · answer {size} bytes" if size is not None else ""
        problem = f" · {d['output_error']}" if d.get("output_error") else ""
        seconds = (d.get("duration_ms") or 0) / 1000
        return "Agent", f"{ending} after {seconds:.1f} s{answer}{problem}"
    if t == "sandbox.exec":
        cmd = d.get("command")
        text = (
            f"$ {_first_line(cmd)}" if cmd is not None else f"$ ({d.get('command_bytes', 0)} bytes)"
        )
        user = "" if d.get("user") in (None, "worker") else f" (as {d.get('user')})"
        ending = " (timed out)" if d.get("timed_out") else ""
        return "Exec", f"{text}{user}  → exit {d.get('exit_code')}{ending}"
    if t in ("web.requested", "web.denied"):
        verdict = d.get("status") if t == "web.requested" else f"denied: {d.get('reason')}"
        return "Web", f"{d.get('method')} {d.get('url', '')} → {verdict}"
    if t in ("connection.requested", "connection.denied"):
        verdict = d.get("status") if t == "connection.requested" else f"denied: {d.get('reason')}"
        return "Connection", f"{d.get('name')} {d.get('method')} {d.get('path', '')} → {verdict}"
    if t == "budget.warning":
        return (
            "Budget",
            f"80 % used · {usd(d.get('spent_micros'))} spent, "
            f"{usd(d.get('remaining_micros'))} left",
        )
    if t == "budget.overrun":
        return (
            "Budget",
            f"OVERRUN · {d.get('model')} reported {usd(d.get('reported_micros'))} against "
            f"{usd(d.get('held_micros'))} held; {usd(d.get('charged_micros'))} charged, "
            f"{usd(d.get('unbilled_micros'))} past the reservation not charged",
        )
    if t == "sandbox.destroyed":
        return "Sandbox", f"destroyed after {d.get('lifetime_ms', 0) / 1000:.1f} s"
    if t.startswith("run.") and t not in ("run.output", "run.settled", "run.queued"):
        status = t.split(".", 1)[1].replace("_", " ").capitalize()
        return status, (
            f"{d.get('model_calls')} model calls, {d.get('tokens', 0):,} tokens"
            + ("" if d.get("reason") in (None, "completed") else f" · {d.get('reason')}")
        )
    if t == "run.output":
        return "Output", _first_line(d.get("markdown"))
    if t == "run.settled":
        b = d.get("breakdown") or {}
        return "Settled", (
            f"{usd(d.get('charged_micros'))} charged, {usd(d.get('refunded_micros'))} refunded"
            f" (model {usd(b.get('model_micros', 0))} · web {usd(b.get('web_micros', 0))}"
            f" · compute {usd(b.get('compute_micros', 0))})"
        )
    return t, ""
