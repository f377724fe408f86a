"""The sample's sandbox configuration: an Inspect config object or a YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ephemeral import errors
from ephemeral.policy import MAX_COST_MICROS, Policy
from ephemeral.sessions.requests import SessionRequest
from ephemeral.settings import Isolation


class EphemeralSandboxConfig(BaseModel):
    """What ``sandbox=("ephemeral", config)`` takes; every field is optional.

    ``timeout_seconds`` and ``max_cost_micros`` are per sample (one session per sample):
    the sample's sandbox is destroyed at whichever comes first.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    isolation: Isolation = "auto"
    image: str | None = Field(default=None, description="a built image (when images exist)")
    web: bool | dict[str, list[str]] = Field(
        default=False,
        description='true, false or {"allow": [host patterns]}: egress through the broker',
    )
    timeout_seconds: int = Field(default=900, ge=1, le=3600)
    max_cost_micros: int = Field(default=800_000, ge=1, le=MAX_COST_MICROS)
    zero_data_retention: bool = False
    pool_size: int = Field(default=2, ge=0, le=64, description="warm sandboxes (in-process)")

    def session_request(self) -> SessionRequest:
        fields: dict[str, Any] = {
            "isolation": self.isolation,
            "web": self.web,
            "timeout_seconds": self.timeout_seconds,
            "max_cost_micros": self.max_cost_micros,
            "zero_data_retention": self.zero_data_retention,
        }
        if self.image is not None:
            if "image" not in Policy.model_fields:
                raise errors.InvalidRequest.field(
                    "image", "this version of ephemeral has no images other than the default"
                )
            fields["image"] = self.image
        try:
            return SessionRequest.model_validate(fields)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(map(str, first["loc"])) or "config"
            raise errors.InvalidRequest.field(field, first["msg"]) from None


def load_config(config: object) -> EphemeralSandboxConfig:
    """None, a config object, a dict or a YAML file path → the config; errors name the field."""
    if config is None:
        return EphemeralSandboxConfig()
    if isinstance(config, EphemeralSandboxConfig):
        return config
    if isinstance(config, str):
        path = Path(config)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as exc:
            raise errors.InvalidRequest.field("config", f"cannot read {path}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise errors.InvalidRequest.field("config", f"{path}: not YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise errors.InvalidRequest.field("config", f"{path}: must be a mapping")
        return _validate(data, where=str(path))
    if isinstance(config, dict):
        return _validate(config, where="config")
    if isinstance(config, BaseModel):
        return _validate(config.model_dump(), where=type(config).__name__)
    raise errors.InvalidRequest.field("config", f"unsupported config {type(config).__name__}")


def _validate(data: dict[str, Any], *, where: str) -> EphemeralSandboxConfig:
    try:
        return EphemeralSandboxConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(map(str, first["loc"])) or "config"
        raise errors.InvalidRequest.field(field, f"{where}: {first['msg']}") from None
