"""What the model gateway lets through: an allow list of request fields per wire format.

A guest's body used to go upstream as it came (but for ``model`` and the max-tokens field), so
whatever a provider bills beyond tokens, or fetches on its own, was the guest's to ask for:
``n: 128``, a priority ``service_tier``, server-side tools (web search, code execution, MCP),
media the provider downloads from a URL, OpenRouter's fallback ``models``. Here every field
the gateway forwards is named, per wire format, down to the ``type`` of each content part,
tool and input item; anything else is refused before a byte goes upstream, naming the field
(``docs/broker.md`` prints these tables; ``tests/gateway/test_fields.py`` checks that the
docs and this module agree).

Leaf values are left to the provider (a wrong type is its 400, which costs nothing); what is
checked is every key, every ``type`` discriminator, every URL (only ``data:`` URLs and
base64 pass: a provider never fetches for the guest) and the few values that change the bill
(``n``, ``service_tier``, ``modalities``, ``include``, a cache's ``ttl``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from ephemeral.broker.gateway_wire import MESSAGES, RESPONSES

MAX_DEPTH: Final = 64  # nested content (a tool result holding blocks): deeper is refused
MAX_PARTS: Final = 10_000  # content parts, items and tools of one request, all counted


class Refused(Exception):
    """A request field the gateway does not forward; ``field`` is its path (``tools[0].type``)."""

    def __init__(self, field: str, message: str, *, unknown: bool = False) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.unknown = unknown  # not in the allow list at all (else: a value refused)


@dataclass
class Found:
    """What a checked request holds that the hold must cover beyond its bytes."""

    media: int = 0  # images and documents (each may cost more tokens than its bytes)
    tools: bool = False  # tool definitions (Anthropic adds a tool-use system prompt)
    parts: int = 0


Check = Callable[[Any, str, Found, int], None]


def _any(value: Any, path: str, found: Found, depth: int) -> None:
    """A leaf the provider validates itself."""


def _one_of(*allowed: Any, why: str = "") -> Check:
    def check(value: Any, path: str, found: Found, depth: int) -> None:
        if value not in allowed:
            shown = ", ".join(repr(a) for a in allowed)
            raise Refused(path, f"{value!r} is not forwarded (allowed: {shown}){why}")

    return check


def _no_url(value: Any, path: str, found: Found, depth: int) -> None:
    """A media field: a ``data:`` URL or plain base64, never an address the provider fetches."""
    if isinstance(value, str) and ":" in value[:64] and not value[:5].lower() == "data:":
        raise Refused(
            path,
            "only data: URLs and base64 are forwarded (the provider would fetch this address; "
            "the sandbox has no web through the model gateway)",
        )


def _media(check: Check) -> Check:
    def counted(value: Any, path: str, found: Found, depth: int) -> None:
        found.media += 1
        check(value, path, found, depth)

    return counted


def _obj(fields: Mapping[str, Check]) -> Check:
    def check(value: Any, path: str, found: Found, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise Refused(path, f"nested deeper than {MAX_DEPTH}")
        if not isinstance(value, dict):
            return  # a wrong type is the provider's 400
        for key, item in value.items():
            spec = fields.get(key)
            where = f"{path}.{key}" if path else str(key)
            if spec is None:
                raise Refused(where, "is not a field the model gateway forwards", unknown=True)
            spec(item, where, found, depth + 1)

    return check


def _list(item: Check) -> Check:
    def check(value: Any, path: str, found: Found, depth: int) -> None:
        if not isinstance(value, list):
            return
        found.parts += len(value)
        if found.parts > MAX_PARTS:
            raise Refused(path, f"more than {MAX_PARTS} parts in one request")
        for i, v in enumerate(value):
            item(v, f"{path}[{i}]", found, depth + 1)

    return check


def _text_or(parts: Check) -> Check:
    """A string, or a list of parts."""

    def check(value: Any, path: str, found: Found, depth: int) -> None:
        if isinstance(value, list):
            parts(value, path, found, depth)

    return check


def _tagged(
    kinds: Mapping[str, Mapping[str, Check]], *, default: str | None = None, why: str = ""
) -> Check:
    """An object told apart by ``type``: each type has its own fields; other types refused."""
    objs = {kind: _obj({"type": _any, **fields}) for kind, fields in kinds.items()}

    def check(value: Any, path: str, found: Found, depth: int) -> None:
        if not isinstance(value, dict):
            return
        kind = value.get("type", default)
        spec = objs.get(kind) if isinstance(kind, str) else None
        if spec is None:
            allowed = ", ".join(sorted(kinds))
            raise Refused(
                f"{path}.type",
                f"{kind!r} is not forwarded by the model gateway (types: {allowed}){why}",
            )
        spec(value, path, found, depth)

    return check


def _tools(kinds: Mapping[str, Mapping[str, Check]], *, default: str | None = None) -> Check:
    why = "; a tool of any other type runs at the provider, and is billed apart"
    inner = _list(_tagged(kinds, default=default, why=why))

    def check(value: Any, path: str, found: Found, depth: int) -> None:
        found.tools = found.tools or (isinstance(value, list) and bool(value))
        inner(value, path, found, depth)

    return check


def _n_one(value: Any, path: str, found: Found, depth: int) -> None:
    if value != 1 or isinstance(value, bool):
        raise Refused(path, f"{value!r} is not forwarded: one choice per call (n = 1)")


# -- OpenAI Chat Completions (also OpenRouter's) -------------------------------------------------
_CHAT_FUNCTION_TOOL: Final = {"function": {"function": _any}, "custom": {"custom": _any}}
_CHAT_PARTS: Final[dict[str, dict[str, Check]]] = {
    "text": {"text": _any},
    "image_url": {"image_url": _media(_obj({"url": _no_url, "detail": _any}))},
    "file": {"file": _media(_obj({"file_data": _no_url, "filename": _any}))},
    "refusal": {"refusal": _any},
}
_CHAT_PART: Final = _tagged(_CHAT_PARTS)
_CHAT_MESSAGE_FIELDS: Final[dict[str, Check]] = {
    "role": _one_of("system", "developer", "user", "assistant", "tool", "function"),
    "content": _text_or(_list(_CHAT_PART)),
    "name": _any,
    "tool_calls": _list(
        _tagged(
            {
                "function": {"id": _any, "function": _any},
                "custom": {"id": _any, "custom": _any},
            }
        )
    ),
    "tool_call_id": _any,
    "function_call": _any,
    "refusal": _any,
}
_CHAT_MESSAGE: Final = _obj(_CHAT_MESSAGE_FIELDS)
_JSON_FORMATS: Final = {"text": {}, "json_object": {}, "json_schema": {"json_schema": _any}}
_TOOL_CHOICE_CHAT: Final = _tagged(
    {
        **_CHAT_FUNCTION_TOOL,
        "allowed_tools": {
            "allowed_tools": _obj({"mode": _any, "tools": _list(_tagged(_CHAT_FUNCTION_TOOL))})
        },
    }
)
OPENAI_TIERS: Final = ("auto", "default")  # absent is "auto": the project's own tier
ANTHROPIC_TIERS: Final = ("auto", "standard_only")  # absent is "auto"
_SERVICE_TIER: Final = _one_of(
    *OPENAI_TIERS, why="; other tiers bill at other prices than the price book's"
)

CHAT_FIELDS: Final[dict[str, Check]] = {
    "model": _any,
    "messages": _list(_CHAT_MESSAGE),
    "stream": _any,
    "stream_options": _obj({"include_usage": _any, "include_obfuscation": _any}),
    "max_tokens": _any,
    "max_completion_tokens": _any,
    "temperature": _any,
    "top_p": _any,
    "frequency_penalty": _any,
    "presence_penalty": _any,
    "stop": _any,
    "seed": _any,
    "logit_bias": _any,
    "logprobs": _any,
    "top_logprobs": _any,
    "response_format": _tagged(_JSON_FORMATS),
    "tools": _tools(_CHAT_FUNCTION_TOOL),
    "tool_choice": _TOOL_CHOICE_CHAT,  # a string (none, auto, required) or one of these
    "parallel_tool_calls": _any,
    "functions": _any,  # the deprecated form of function tools: plain functions only
    "function_call": _any,
    "reasoning_effort": _any,
    "verbosity": _any,
    "user": _any,
    "safety_identifier": _any,
    "prompt_cache_key": _any,
    "metadata": _any,
    "store": _any,
    "n": _n_one,
    "service_tier": _SERVICE_TIER,
    "modalities": _one_of(["text"], why="; audio is priced apart"),
}
# OpenRouter's own sampling and accounting fields. Not ``models``/``route`` (fallbacks to models
# not granted), ``provider`` (routing that changes the price), ``plugins`` (web search, file
# fetches) or ``transforms``.
OPENROUTER_EXTRA: Final[dict[str, Check]] = {
    "top_k": _any,
    "min_p": _any,
    "top_a": _any,
    "repetition_penalty": _any,
    "reasoning": _obj({"effort": _any, "exclude": _any, "enabled": _any}),
    "usage": _obj({"include": _any}),
}

# -- OpenAI Responses ------------------------------------------------------------------------------
_RESPONSES_PARTS: Final[dict[str, dict[str, Check]]] = {
    "input_text": {"text": _any},
    "input_image": {"image_url": _media(_no_url), "detail": _any},
    "input_file": {"file_data": _media(_no_url), "filename": _any},
    "output_text": {"text": _any, "annotations": _any, "logprobs": _any},
    "refusal": {"refusal": _any},
}
_RESPONSES_PART: Final = _tagged(_RESPONSES_PARTS)
_RESPONSES_ITEMS: Final[dict[str, dict[str, Check]]] = {
    "message": {
        "role": _one_of("system", "developer", "user", "assistant"),
        "content": _text_or(_list(_RESPONSES_PART)),
        "id": _any,
        "status": _any,
    },
    "function_call": {
        "id": _any,
        "call_id": _any,
        "name": _any,
        "arguments": _any,
        "status": _any,
    },
    "function_call_output": {"id": _any, "call_id": _any, "output": _any, "status": _any},
    "custom_tool_call": {"id": _any, "call_id": _any, "name": _any, "input": _any},
    "custom_tool_call_output": {"id": _any, "call_id": _any, "output": _any},
    "reasoning": {
        "id": _any,
        "summary": _any,
        "content": _any,
        "encrypted_content": _any,
        "status": _any,
    },
}
_RESPONSES_ITEM: Final = _tagged(_RESPONSES_ITEMS, default="message")
_RESPONSES_TOOL: Final = {
    "function": {"name": _any, "description": _any, "parameters": _any, "strict": _any},
    "custom": {"name": _any, "description": _any, "format": _any},
}
_TOOL_CHOICE_RESPONSES: Final = _tagged(
    {
        "function": {"name": _any},
        "custom": {"name": _any},
        "allowed_tools": {
            "mode": _any,
            "tools": _list(_tagged({"function": {"name": _any}, "custom": {"name": _any}})),
        },
    }
)

RESPONSES_INCLUDES: Final = ("reasoning.encrypted_content", "message.output_text.logprobs")
RESPONSES_FIELDS: Final[dict[str, Check]] = {
    "model": _any,
    "input": _text_or(_list(_RESPONSES_ITEM)),
    "instructions": _any,
    "stream": _any,
    "stream_options": _obj({"include_obfuscation": _any}),
    "max_output_tokens": _any,
    "temperature": _any,
    "top_p": _any,
    "top_logprobs": _any,
    "tools": _tools(_RESPONSES_TOOL),
    "tool_choice": _TOOL_CHOICE_RESPONSES,
    "parallel_tool_calls": _any,
    "text": _obj(
        {
            "format": _tagged(
                {
                    "text": {},
                    "json_object": {},
                    "json_schema": {
                        "name": _any,
                        "schema": _any,
                        "description": _any,
                        "strict": _any,
                    },
                }
            ),
            "verbosity": _any,
        }
    ),
    "reasoning": _obj({"effort": _any, "summary": _any, "generate_summary": _any}),
    "include": _list(_one_of(*RESPONSES_INCLUDES)),
    "truncation": _one_of("auto", "disabled"),
    "metadata": _any,
    "store": _any,
    "user": _any,
    "safety_identifier": _any,
    "prompt_cache_key": _any,
    "service_tier": _SERVICE_TIER,
}

# -- Anthropic Messages ----------------------------------------------------------------------------
_CACHE: Final = _obj(
    {"type": _one_of("ephemeral"), "ttl": _one_of("5m", why="; a 1 h cache write bills 2x input")}
)
_TEXT_BLOCK: Final = {"text": _any, "cache_control": _CACHE, "citations": _any}
_FETCHED: Final = "; the provider would fetch or read what a URL or file source names"
_IMAGE_BLOCK: Final = {
    "source": _media(_tagged({"base64": {"media_type": _any, "data": _any}}, why=_FETCHED)),
    "cache_control": _CACHE,
}


def _blocks(value: Any, path: str, found: Found, depth: int) -> None:
    _BLOCK(value, path, found, depth)


_BLOCKS: Final[dict[str, dict[str, Check]]] = {
    "text": _TEXT_BLOCK,
    "image": _IMAGE_BLOCK,
    "document": {
        "source": _media(
            _tagged(
                {
                    "base64": {"media_type": _any, "data": _any},
                    "text": {"media_type": _any, "data": _any},
                    "content": {"content": _text_or(_list(_blocks))},
                },
                why=_FETCHED,
            )
        ),
        "title": _any,
        "context": _any,
        "citations": _any,
        "cache_control": _CACHE,
    },
    "tool_use": {"id": _any, "name": _any, "input": _any, "cache_control": _CACHE},
    "tool_result": {
        "tool_use_id": _any,
        "content": _text_or(_list(_blocks)),
        "is_error": _any,
        "cache_control": _CACHE,
    },
    "thinking": {"thinking": _any, "signature": _any},
    "redacted_thinking": {"data": _any},
}
_BLOCK: Final = _tagged(_BLOCKS)

_MESSAGES_TOOLS: Final = {
    "custom": {"name": _any, "description": _any, "input_schema": _any, "cache_control": _CACHE}
}
MESSAGES_FIELDS: Final[dict[str, Check]] = {
    "model": _any,
    "messages": _list(
        _obj({"role": _one_of("user", "assistant"), "content": _text_or(_list(_BLOCK))})
    ),
    "max_tokens": _any,
    "system": _text_or(_list(_tagged({"text": _TEXT_BLOCK}))),
    "stream": _any,
    "temperature": _any,
    "top_p": _any,
    "top_k": _any,
    "stop_sequences": _any,
    "metadata": _obj({"user_id": _any}),
    # A tool with no ``type`` (or ``custom``) is the client's own; every typed one
    # (``web_search_…``, ``web_fetch_…``, ``code_execution_…``, ``bash_…``, ``computer_…``,
    # memory, MCP toolsets) runs at the provider or is billed apart.
    "tools": _tools(_MESSAGES_TOOLS, default="custom"),
    "tool_choice": _tagged(
        {
            "auto": {"disable_parallel_tool_use": _any},
            "any": {"disable_parallel_tool_use": _any},
            "tool": {"name": _any, "disable_parallel_tool_use": _any},
            "none": {},
        }
    ),
    "thinking": _tagged({"enabled": {"budget_tokens": _any}, "disabled": {}}),
    "service_tier": _one_of(
        *ANTHROPIC_TIERS, why="; other tiers bill at other prices than the price book's"
    ),
}
ANTHROPIC_VERSIONS: Final = frozenset({"2023-06-01"})
# Betas that change neither what is billed per token nor what the provider fetches or runs.
# Not: ``context-1m-…`` (input past 200k tokens bills at a premium), ``web-fetch-…``,
# ``mcp-client-…``, ``code-execution-…``, ``files-api-…``, ``computer-use-…``, ``skills-…``.
ANTHROPIC_BETAS: Final = frozenset(
    {
        "prompt-caching-2024-07-31",
        "pdfs-2024-09-25",
        "token-efficient-tools-2025-02-19",
        "output-128k-2025-02-19",
        "interleaved-thinking-2025-05-14",
        "fine-grained-tool-streaming-2025-05-14",
    }
)


def fields_for(api: str, provider: str) -> dict[str, Check]:
    """The allow list of a wire format's top-level fields (``provider``: the grant's prefix)."""
    if api == MESSAGES:
        return MESSAGES_FIELDS
    if api == RESPONSES:
        return RESPONSES_FIELDS
    return {**CHAT_FIELDS, **OPENROUTER_EXTRA} if provider == "openrouter" else CHAT_FIELDS


def check_body(api: str, provider: str, body: dict[str, Any]) -> Found:
    """Refuse (``Refused``) any field of ``body`` the gateway does not forward."""
    found = Found()
    try:
        _obj(fields_for(api, provider))(body, "", found, 0)
    except RecursionError:
        raise Refused("body", "nested too deeply") from None
    return found


def check_headers(api: str, header: Callable[[str], str | None]) -> None:
    """Refuse an Anthropic version or beta the gateway does not forward (no other guest header
    goes upstream at all)."""
    if api != MESSAGES:
        return
    version = header("anthropic-version")
    if version is not None and version.strip() not in ANTHROPIC_VERSIONS:
        raise Refused("anthropic-version", f"{version[:100]!r} is not forwarded")
    beta = header("anthropic-beta")
    for name in (b.strip() for b in (beta or "").split(",")):
        if name and name not in ANTHROPIC_BETAS:
            raise Refused(
                "anthropic-beta",
                f"{name[:100]!r} is not forwarded by the model gateway "
                f"(allowed: {', '.join(sorted(ANTHROPIC_BETAS))})",
            )


# What docs/broker.md prints, list by list (``tests/gateway/test_fields.py`` compares them).
ALLOW_LISTS: Final[dict[str, tuple[str, ...]]] = {
    "chat.completions fields": tuple(CHAT_FIELDS),
    "chat.completions fields, OpenRouter only": tuple(OPENROUTER_EXTRA),
    "chat.completions message fields": tuple(_CHAT_MESSAGE_FIELDS),
    "chat.completions content part types": tuple(_CHAT_PARTS),
    "chat.completions tool types": tuple(_CHAT_FUNCTION_TOOL),
    "chat.completions / responses service_tier": OPENAI_TIERS,
    "responses fields": tuple(RESPONSES_FIELDS),
    "responses input item types": tuple(_RESPONSES_ITEMS),
    "responses content part types": tuple(_RESPONSES_PARTS),
    "responses tool types": tuple(_RESPONSES_TOOL),
    "responses include": RESPONSES_INCLUDES,
    "messages fields": tuple(MESSAGES_FIELDS),
    "messages content block types": tuple(_BLOCKS),
    "messages tool types": tuple(_MESSAGES_TOOLS),
    "messages service_tier": ANTHROPIC_TIERS,
    "anthropic-version": tuple(sorted(ANTHROPIC_VERSIONS)),
    "anthropic-beta": tuple(sorted(ANTHROPIC_BETAS)),
}
