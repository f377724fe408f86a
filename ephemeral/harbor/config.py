"""What ``--ek key=value`` sets on the Harbor environment (every key optional)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ephemeral.policy import IMAGE_PATTERN, MAX_COST_MICROS
from ephemeral.settings import Isolation

ImageName = str


class HarborConfig(BaseModel):
    """Per trial (one sandbox session each): the time limit and the money cap apply to the
    trial's whole life in its sandbox, environment setup, agent and verifier together."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    isolation: Isolation = "auto"
    image: str | None = Field(
        default=None,
        pattern=IMAGE_PATTERN,
        description="run every task in this built image, whatever its Dockerfile says",
    )
    images: dict[str, ImageName] = Field(
        default_factory=dict,
        description="docker_image name -> a built image of ours (tasks without a Dockerfile)",
    )
    web: bool = Field(
        default=False,
        description="let tasks with network_mode public or allowlist out through the broker",
    )
    retry_failed: bool = Field(
        default=False,
        description="build again a Dockerfile whose build failed before (else its error at once)",
    )
    timeout_seconds: int = Field(default=3600, ge=1, le=3600)
    max_cost_micros: int = Field(default=5_000_000, ge=1, le=MAX_COST_MICROS)
    zero_data_retention: bool = False
    cpus: float = Field(default=1.0, gt=0, le=64, description="when the task sets none")
    memory_mb: int = Field(default=1024, ge=64, le=1 << 20, description="when the task sets none")
    storage_mb: int = Field(
        default=1024, ge=16, le=1 << 20, description="when the task sets none (capped below)"
    )
    max_storage_mb: int = Field(
        default=4096, ge=16, le=1 << 20, description="the most a task's storage_mb may get"
    )
    pids: int = Field(default=1024, ge=64, le=1 << 16)


def load_config(values: dict[str, Any]) -> HarborConfig:
    """The ``--ek`` values; a bad one is a ValueError naming its key."""
    try:
        cfg = HarborConfig.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(map(str, first["loc"])) or "kwargs"
        raise ValueError(f"ephemeral environment: --ek {key}: {first['msg']}") from None
    for docker_image, name in cfg.images.items():
        if not re.match(IMAGE_PATTERN, name):
            raise ValueError(
                f"ephemeral environment: --ek images: {docker_image!r} maps to {name!r}, "
                "not an image name"
            )
    return cfg
