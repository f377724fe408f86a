"""Saved samples: a real run's events, kept as JSON and replayed on ``/samples/{name}``.

``recipes/samples/<name>.events.json`` is written by :func:`save_sample` from a real run of
recipe ``recipes/<name>.yaml`` (real sandbox, the recipe's model), so the page replays what a
sandbox really answered, with the real timings between events.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from ephemeral import errors
from ephemeral.events import Event
from ephemeral.ids import rfc3339, utcnow
from ephemeral.lifecycle import RunStatus
from ephemeral.models import default_model
from ephemeral.runview import fold_events
from ephemeral.settings import Settings

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
MAX_SAMPLE_BYTES = 4 << 20


class Sample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = 1
    name: str
    description: str
    model: str
    recorded_at: str
    run_id: str
    prompt: str
    policy: dict[str, Any]
    events: list[Event]


def samples_dir(settings: Settings) -> Path:
    return settings.recipes_dir / "samples"


def sample_path(settings: Settings, name: str) -> Path:
    if not _NAME.match(name):
        raise errors.NotFound(f"no sample named {name!r}")
    return samples_dir(settings) / f"{name}.events.json"


def load_sample(settings: Settings, name: str) -> Sample:
    path = sample_path(settings, name)
    if not path.is_file():
        raise errors.NotFound(f"no sample named {name!r}")
    if path.stat().st_size > MAX_SAMPLE_BYTES:
        raise errors.InvalidRequest.field("sample", f"{path.name} is over {MAX_SAMPLE_BYTES} bytes")
    try:
        sample = Sample.model_validate_json(path.read_text())
        fold_events(sample.events)  # in order, and a run can be rebuilt from them
    except ValueError as exc:
        raise errors.InvalidRequest.field("sample", f"{path.name}: {exc}") from exc
    return sample


async def save_sample(runtime: Any, name: str) -> Path:
    """Run recipe ``name`` once for real and keep its events as the sample (takes seconds)."""
    from ephemeral.policy import RunRequest
    from ephemeral.recipes.recipe import expand, load_recipe

    settings: Settings = runtime.settings
    recipe = load_recipe(settings.recipes_dir / f"{name}.yaml")
    planned = expand(recipe, default_model=default_model(settings))[0]
    request = RunRequest(prompt=planned.prompt, model=planned.model, **planned.policy.model_dump())
    org = await runtime.local_org()
    row, _ = await runtime.admit(org, request, labels={"sample": name})
    row = await runtime.execute(row.id)
    events = await runtime.store.events.list(row.id)
    if row.status != RunStatus.SUCCEEDED:
        raise errors.SandboxError(f"the sample run ended {row.status}; not recording it")
    sample = Sample(
        name=name,
        description=recipe.description or "",
        model=row.model,
        recorded_at=rfc3339(utcnow()),
        run_id=row.id,
        prompt=planned.prompt,
        policy=row.policy,
        events=events,
    )
    path = sample_path(settings, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(sample.model_dump(mode="json"), indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path
