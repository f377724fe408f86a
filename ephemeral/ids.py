"""Identifiers and clocks shared by every layer."""

from __future__ import annotations

import re
import secrets
from datetime import UTC, datetime

RUN_ID_RE = re.compile(r"^run_[0-9a-f]{32}$")


def new_run_id() -> str:
    return "run_" + secrets.token_hex(16)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def utcnow() -> datetime:
    return datetime.now(UTC)


def rfc3339(ts: datetime) -> str:
    """RFC 3339 with milliseconds and a Z, as every event and run timestamp is written."""
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z"
