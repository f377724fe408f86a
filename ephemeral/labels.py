"""Labels: a small string map on a run, a sandbox session or a recipe, for attributing cost.

``POST /v1/runs``, ``POST /v1/sandboxes`` and a recipe's ``labels:`` take one; the recipe
runner, the Harbor environment and the Inspect provider add their own (``recipe``,
``suite_run_id``, ``harbor_job``, ``harbor_task``, ``harbor_trial``, ``inspect_task``,
``inspect_sample``). They are stored with the run and in the records (``runs.labels``), so
``ephemeral costs --by label:team`` groups spend by them.

Bounded, since they come from callers and task authors: at most :data:`MAX_LABELS` entries,
keys of 1-63 characters ``[A-Za-z0-9][A-Za-z0-9_.-]*``, values of at most 256 characters with
no control characters. The names the recipe runner and the API set are reserved: a caller
cannot pass a run off as another recipe's or suite run's. The integrations' names
(``harbor_*``, ``inspect_*``) are ordinary labels, which they send like any caller.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, Field, StringConstraints

MAX_LABELS = 32
MAX_KEY = 63
MAX_VALUE = 256
KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
_KEY = re.compile(KEY_PATTERN)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# Set by the recipe runner (ephemeral.evals) and the API (samples, playground); never by a caller.
RESERVED = frozenset(
    {
        "recipe",
        "cell",
        "repeat_index",
        "suite_run_id",
        "checks",
        "sample",
        "source",
    }
)


def _value(v: str) -> str:
    if _CONTROL.search(v):
        raise ValueError("must not contain control characters")
    return v


def _not_reserved(labels: dict[str, str]) -> dict[str, str]:
    taken = sorted(RESERVED & set(labels))
    if taken:
        raise ValueError(
            f"{', '.join(repr(k) for k in taken)} reserved: set by Ephemeral itself "
            f"(reserved: {', '.join(sorted(RESERVED))})"
        )
    return labels


LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=MAX_KEY, pattern=KEY_PATTERN)]
LabelValue = Annotated[str, StringConstraints(max_length=MAX_VALUE), AfterValidator(_value)]
Labels = Annotated[
    dict[LabelKey, LabelValue],
    Field(
        max_length=MAX_LABELS,
        description="string map for cost attribution (`costs --by label:KEY`)",
    ),
    AfterValidator(_not_reserved),
]


def bounded(value: object) -> str:
    """A name from a task author (a Harbor job, an Inspect sample id) as a valid label value."""
    return _CONTROL.sub(" ", str(value))[:MAX_VALUE]


def valid_key(key: str) -> bool:
    return len(key) <= MAX_KEY and bool(_KEY.match(key))


def string_labels(labels: Mapping[str, Any] | None) -> dict[str, str]:
    """The string entries of a stored run's labels (what the records keep and costs group by);
    the structured ones (``cell``, ``checks``, ``repeat_index``) have columns of their own."""
    return {k: v for k, v in (labels or {}).items() if isinstance(v, str) and valid_key(k)}
