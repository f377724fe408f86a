"""Options shared by every task: no caching, no persisted results.

Task inputs are live objects (the run, its sandbox); hashing them for a cache key is wasted
work, and persisting results would copy prompts and outputs into Prefect's database.
"""

from __future__ import annotations

from typing import Any

from prefect.cache_policies import NO_CACHE

TASK_OPTIONS: dict[str, Any] = {
    "cache_policy": NO_CACHE,
    "persist_result": False,
    "log_prints": False,
}
