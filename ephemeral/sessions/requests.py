"""What a client sends a sandbox session: the body of ``POST /v1/sandboxes`` and of one
command (``POST /v1/sandboxes/{id}/exec``), and the sizes they are bounded by.

Apart from the manager (``ephemeral.sessions.manager``), so a client, the Inspect provider or
Harbor's adapter can build and validate a request without importing the sandbox or the broker.
"""

from __future__ import annotations

import base64
import binascii
import shlex

from pydantic import Field, field_validator, model_validator

from ephemeral.labels import Labels
from ephemeral.policy import Policy, _fail, _Strict

MAX_EXEC_OUTPUT = 4 << 20  # per stream: two capped streams must fit one 16 MiB guest frame
DEFAULT_EXEC_OUTPUT = 1 << 20
MAX_FILE_BYTES = 128 << 20  # per file read or written (the sandbox's /tmp is 256 MiB)
MAX_ARGV_BYTES = 2 << 20


class SessionRequest(Policy):
    """The body of ``POST /v1/sandboxes``: a run's policy fields, nothing else.

    ``web`` and ``connections`` work as for a run: the sandbox gets the broker's egress
    forwarder and every exec'd command its proxy variables (``ephemeral.broker.attach``).
    ``labels`` as for a run (``ephemeral.labels``)."""

    labels: Labels = Field(default_factory=dict)

    @model_validator(mode="after")
    def _no_setup_or_verify(self) -> SessionRequest:
        # A session has no agent turn to run them around: its client runs commands with exec.
        for name in ("setup", "verify", "verify_timeout_seconds", "verify_files"):
            if getattr(self, name):
                _fail(
                    (name,),
                    getattr(self, name),
                    "not available to sandbox sessions: run the commands with exec",
                )
        return self

    def policy(self) -> Policy:
        return Policy.model_validate(self.model_dump(include=set(Policy.model_fields)))


class ExecRequest(_Strict):
    """One command in a session (the body of ``POST /v1/sandboxes/{id}/exec``)."""

    command: list[str] | str = Field(
        description="an argv (run directly) or a shell string (run with sh -c)"
    )
    stdin_base64: str = Field(default="", description="bytes for the command's stdin, base64")
    stdin_path: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="read stdin from this file in the sandbox instead (opened as `user`)",
    )
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(default=None, min_length=1, max_length=4096)
    user: str | None = Field(
        default=None,
        pattern=r"^([a-z_][a-z0-9_.-]{0,31}|[0-9]{1,10})$",
        description="a user of the image (name or uid); default the worker (uid 1000)",
    )
    timeout_seconds: float | None = Field(default=None, gt=0, le=3600)
    max_output_bytes: int = Field(default=DEFAULT_EXEC_OUTPUT, ge=0, le=MAX_EXEC_OUTPUT)

    @field_validator("command")
    @classmethod
    def _command(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, str):
            if not v.strip():
                raise ValueError("must not be empty")
            if len(v.encode()) > MAX_ARGV_BYTES:
                raise ValueError(f"longer than {MAX_ARGV_BYTES} bytes")
            return v
        if not v:
            raise ValueError("an argv needs at least one element")
        if sum(len(a.encode()) + 1 for a in v) > MAX_ARGV_BYTES:
            raise ValueError(f"longer than {MAX_ARGV_BYTES} bytes")
        if any("\0" in a for a in v):
            raise ValueError("must not contain NUL")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k, value in v.items():
            if not k or "=" in k or "\0" in k or len(k) > 255:
                raise ValueError(f"bad variable name {k[:40]!r}")
            if "\0" in value:
                raise ValueError(f"{k[:40]}: a value must not contain NUL")
        return v

    @field_validator("stdin_base64")
    @classmethod
    def _stdin(cls, v: str) -> str:
        try:
            base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("is not valid base64") from exc
        return v

    def stdin(self) -> bytes:
        return base64.b64decode(self.stdin_base64)

    def display(self) -> str:
        return self.command if isinstance(self.command, str) else shlex.join(self.command)
