"""The provider seam: one message shape for every model API, and the protocol each adapter keeps.

The agent loop speaks only these types. Each adapter translates them to one wire format
(Chat Completions, Anthropic Messages) or plays them back from a cassette (replay).

Conventions every adapter keeps:

- ``Usage.input_tokens`` counts *all* prompt tokens, including those served from a cache;
  ``cached_input_tokens`` is the part of them that was a cache hit (priced lower).
- ``ModelReply.stop_reason`` is normalised to one of :data:`STOP_REASONS`, so the loop never
  needs to know which API answered.
- Errors: :class:`~ephemeral.errors.TransientModelError` (with ``retry_after`` in seconds when
  the provider said so) for 429, 5xx, connection failures and timeouts; otherwise
  :class:`~ephemeral.errors.ModelError`. No error text ever contains an API key.
"""

from __future__ import annotations

import json
from typing import Any, Final, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

STOP_END: Final = "end"  # the model finished its turn (answer or pause)
STOP_TOOL_USE: Final = "tool_use"  # the model wants the tool calls in the message run
STOP_MAX_TOKENS: Final = "max_tokens"  # cut off by ``max_tokens``; the message is incomplete
STOP_REFUSAL: Final = "refusal"  # content filter or refusal
STOP_OTHER: Final = "other"  # anything the provider added that we do not know yet
STOP_REASONS: Final = frozenset(
    {STOP_END, STOP_TOOL_USE, STOP_MAX_TOKENS, STOP_REFUSAL, STOP_OTHER}
)

RAW_ARGUMENTS_KEY: Final = "_raw"
"""Key under which a tool call's undecodable arguments are kept, so the loop can answer
with a tool error instead of the run failing."""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_invalid(self) -> bool:
        """True when the model sent arguments that were not a JSON object."""
        return set(self.arguments) == {RAW_ARGUMENTS_KEY}


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None


class Usage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_tokens: int = Field(default=0, ge=0)
    output_tokens: int = Field(default=0, ge=0)
    cached_input_tokens: int = Field(default=0, ge=0)


class ModelReply(BaseModel):
    message: Message
    usage: Usage
    stop_reason: str
    latency_ms: int = Field(ge=0)
    provider_cost_micros: int | None = None  # what the provider says it charged (OpenRouter)


class Provider(Protocol):
    async def complete(
        self,
        *,
        model: str,
        messages: list[Message],
        tools: list[ToolSpec],
        max_tokens: int,
        timeout: float,
    ) -> ModelReply: ...


def decode_arguments(raw: object) -> dict[str, Any]:
    """Tool-call arguments as an object; anything else is kept raw for the loop to refuse."""
    if raw is None:  # some servers omit the arguments of a tool that takes none
        return {}
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        if raw.strip() == "":
            return {}
        try:
            value = json.loads(raw)
        except ValueError:
            return {RAW_ARGUMENTS_KEY: raw}
        if isinstance(value, dict):
            return value
        return {RAW_ARGUMENTS_KEY: raw}
    return {RAW_ARGUMENTS_KEY: repr(raw)}


def first_error(exc: ValidationError) -> str:
    """The first schema violation in a provider's answer, as ``where: what``."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(root)"
    return f"{where}: {err['msg']}"
