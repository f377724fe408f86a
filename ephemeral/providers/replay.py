"""Replay: recorded model turns played back while the tools run for real.

A cassette is JSON::

    {"version": 1, "model": "openai/gpt-6-luna", "recorded_at": "…", "prompt": "…",
     "turns": [{"message": {assistant message}, "usage": {…}, "latency_ms": 812}, …]}

A cassette answers only the prompt it recorded (``prompt``, compared with runs of whitespace
made one space): a run with another prompt fails with ``model_error`` naming the mismatch, never
replays a transcript that answers something else. A cassette written by hand as a script for
any prompt says so with ``"any_prompt": true``; one with neither answers nothing.

Which turn to play is derived from the conversation (the number of assistant messages already
in it), not from state in the provider object: the agent loop may build a new provider for each
model step (each Prefect task), and a retried step must get the same turn again.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ephemeral.errors import InvalidRequest, ModelError, UnknownModel
from ephemeral.providers.base import (
    STOP_END,
    STOP_MAX_TOKENS,
    STOP_TOOL_USE,
    Message,
    ModelReply,
    ToolSpec,
    Usage,
    first_error,
)

PREFIX: Final = "replay/"
MAX_CASSETTE_BYTES: Final = 4 * 1024 * 1024
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class CassetteTurn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: Message
    usage: Usage
    latency_ms: int = Field(default=0, ge=0)
    stop_reason: str | None = None

    @field_validator("message")
    @classmethod
    def _assistant(cls, m: Message) -> Message:
        if m.role != "assistant":
            raise ValueError("a recorded turn is an assistant message")
        return m


class Cassette(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    model: str
    recorded_at: str
    description: str | None = None
    # The prompt the recorded turns answer (the run's user message), or the few prompts a
    # hand-written script answers (a dataset's rows); None: see any_prompt.
    prompt: str | list[str] | None = None
    any_prompt: bool = False
    turns: list[CassetteTurn]

    @field_validator("model")
    @classmethod
    def _real_model(cls, v: str) -> str:
        if v.startswith(PREFIX) or "/" not in v:
            raise ValueError("must name the recorded provider model, e.g. openai/gpt-6-luna")
        return v


def _words(text: str) -> str:
    return " ".join(text.split())


def _preview(text: str, limit: int = 80) -> str:
    flat = _words(text)
    return repr(flat if len(flat) <= limit else flat[: limit - 1] + "…")


def prompt_mismatch(cassette: Cassette, name: str, prompt: str) -> str | None:
    """Why cassette ``name`` cannot answer ``prompt`` (None when it can)."""
    if cassette.any_prompt:
        return None
    if cassette.prompt is None:
        return (
            f"{PREFIX}{name} records no prompt, so it answers none: add the prompt its turns "
            'answer as "prompt" (or "any_prompt": true for a script written by hand)'
        )
    known = [cassette.prompt] if isinstance(cassette.prompt, str) else cassette.prompt
    if _words(prompt) in {_words(p) for p in known}:
        return None
    return (
        f"{PREFIX}{name} answers only the prompt it recorded ({_preview(known[0])}"
        f"{f' and {len(known) - 1} more' if len(known) > 1 else ''}), not this run's "
        f"({_preview(prompt)}); name a real model for a new prompt"
    )


def _unknown(model: str, message: str) -> UnknownModel:
    return UnknownModel(f"model: {message}", errors=[{"field": "model", "message": message}])


def cassette_path(cassettes_dir: Path, name: str) -> Path:
    """The file for cassette ``name``; a name that could leave the directory is refused."""
    if not _NAME.fullmatch(name):
        raise _unknown(PREFIX + name, "a cassette name is 1-100 letters, digits, '.', '_' or '-'")
    return cassettes_dir / f"{name}.json"


def load_cassette(path: Path) -> Cassette:
    model = PREFIX + path.stem
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CASSETTE_BYTES + 1)
    except FileNotFoundError:
        raise _unknown(model, f"no cassette {path.name!r} in {path.parent}") from None
    except OSError as exc:
        raise _unknown(model, f"cannot read cassette {path}: {exc.strerror}") from None
    if len(raw) > MAX_CASSETTE_BYTES:
        raise _unknown(model, f"cassette {path} is larger than {MAX_CASSETTE_BYTES} bytes")
    try:
        return Cassette.model_validate_json(raw)
    except ValidationError as exc:
        raise _unknown(model, f"cassette {path} is invalid: {first_error(exc)}") from None


class ReplayProvider:
    def __init__(self, cassette: Cassette, *, name: str) -> None:
        self.cassette = cassette
        self.name = name

    def __repr__(self) -> str:
        return f"ReplayProvider(name={self.name!r}, turns={len(self.cassette.turns)})"

    @classmethod
    def from_file(cls, path: Path) -> ReplayProvider:
        return cls(load_cassette(path), name=path.stem)

    async def complete(
        self,
        *,
        model: str,
        messages: list[Message],
        tools: list[ToolSpec],
        max_tokens: int,
        timeout: float,
    ) -> ModelReply:
        asked = next((m for m in messages if m.role == "user"), None)
        why = prompt_mismatch(self.cassette, self.name, (asked.content if asked else None) or "")
        if why is not None:
            raise ModelError(why)
        index = sum(1 for m in messages if m.role == "assistant")
        turns = self.cassette.turns
        if index >= len(turns):
            raise ModelError(f"{PREFIX}{self.name}: cassette exhausted after {len(turns)} turns")
        turn = turns[index]
        # A tool the run did not offer is returned anyway: refusing it is the loop's job,
        # and it is what a real model asking for it would get.
        message = turn.message.model_copy(deep=True)
        stop = turn.stop_reason or (STOP_TOOL_USE if message.tool_calls else STOP_END)
        usage = turn.usage.model_copy()
        if usage.output_tokens > max_tokens:
            # A real provider never bills past max_tokens; the budget reservation relies on it.
            usage.output_tokens = max_tokens
            stop = STOP_MAX_TOKENS
        return ModelReply(
            message=message, usage=usage, stop_reason=stop, latency_ms=turn.latency_ms
        )


def cassette_from_transcript(
    model: str, messages: list[dict[str, Any]], usages: list[dict[str, Any]], latencies: list[int]
) -> dict[str, Any]:
    """A cassette document from a finished run: its assistant messages in order, each with
    the usage and latency of the call that produced it, and the prompt they answer (its first
    user message). Tool outputs are not kept: replay runs the tools again."""
    if model.startswith(PREFIX):
        raise InvalidRequest.field("model", "a replayed run is already a cassette")
    try:
        parsed = [Message.model_validate(m) for m in messages]
    except ValidationError as exc:
        raise InvalidRequest.field("messages", first_error(exc)) from None
    replies = [m for m in parsed if m.role == "assistant"]
    asked = next((m for m in parsed if m.role == "user"), None)
    if len(usages) != len(replies):
        raise InvalidRequest.field(
            "usages", f"{len(usages)} usages for {len(replies)} assistant messages"
        )
    if len(latencies) != len(replies):
        raise InvalidRequest.field(
            "latencies", f"{len(latencies)} latencies for {len(replies)} assistant messages"
        )
    try:
        cassette = Cassette(
            model=model,
            recorded_at=datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
            prompt=asked.content if asked is not None else None,
            turns=[
                CassetteTurn(message=m, usage=Usage.model_validate(u), latency_ms=lat)
                for m, u, lat in zip(replies, usages, latencies, strict=True)
            ],
        )
    except ValidationError as exc:
        raise InvalidRequest.field("model", first_error(exc)) from None
    return cassette.model_dump(mode="json", exclude_none=True)


def save_cassette(cassettes_dir: Path, name: str, doc: dict[str, Any]) -> Path:
    """Validate ``doc`` and write it as ``<name>.json`` atomically (temp file, then rename)."""
    path = cassette_path(cassettes_dir, name)
    try:
        cassette = Cassette.model_validate(doc)
    except ValidationError as exc:
        raise InvalidRequest.field("cassette", first_error(exc)) from None
    cassettes_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=cassettes_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(cassette.model_dump(mode="json", exclude_none=True), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
