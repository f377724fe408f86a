"""Content removal shared by zero data retention (at write time) and the retention purge.

Content is what a run saw or said: prompts, outputs, commands, their output, URLs and paths,
and the check verdicts' reasons (they quote the output). Billing figures, token counts, times,
sizes, statuses and exit codes are not content and always stay.
"""

from __future__ import annotations

import json
from typing import Any

from ephemeral.events import CONTENT_KEYS, redact_for_zdr


def _redact(value: Any) -> Any:
    # The event contract is flat, but a nested payload must not smuggle content past the rule.
    if isinstance(value, dict):
        return {k: _redact(v) for k, v in redact_for_zdr(value).items()}
    if isinstance(value, list):
        return [_redact(v) for v in value]
    return value


def redact_event_data(data: str | None) -> str | None:
    """Event JSON with every content key replaced by its size; unreadable JSON becomes ``{}``."""
    if data is None:
        return None
    try:
        parsed = json.loads(data)
    except ValueError:
        return "{}"
    if not isinstance(parsed, dict):
        return "{}"
    return json.dumps(_redact(parsed), sort_keys=True)


def event_data_has_content(data: str | None) -> bool:
    """True when :func:`redact_event_data` would change the stored text."""
    return data is not None and redact_event_data(data) != data


REMOVED_REASON = "(removed)"


def redact_checks(checks: str | None) -> str | None:
    """Check verdicts keep their label and pass/fail; the reason (which quotes output) becomes
    ``(removed)``, so the verdicts still load as ``CheckResult`` (eval comparisons read them)."""
    if checks is None:
        return None
    try:
        parsed = json.loads(checks)
    except ValueError:
        return None
    if not isinstance(parsed, list):
        return None
    kept = [
        {**item, "reason": REMOVED_REASON} if isinstance(item, dict) and "reason" in item else item
        for item in parsed
    ]
    return json.dumps(kept, sort_keys=True)


VERIFY_CONTENT = ("command", "stdout", "stderr")


def redact_verify(verify: str | None) -> str | None:
    """Verify results keep exit codes, durations and skips; commands and output go."""
    if verify is None:
        return None
    try:
        parsed = json.loads(verify)
    except ValueError:
        return None
    if not isinstance(parsed, list):
        return None
    kept = [
        {k: v for k, v in item.items() if k not in VERIFY_CONTENT}
        if isinstance(item, dict)
        else item
        for item in parsed
    ]
    return json.dumps(kept, sort_keys=True)


__all__ = [
    "CONTENT_KEYS",
    "REMOVED_REASON",
    "VERIFY_CONTENT",
    "event_data_has_content",
    "redact_checks",
    "redact_event_data",
    "redact_verify",
]
