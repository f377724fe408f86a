"""Which models this host serves: the default a request naming none gets, and the list that
``GET /v1/models`` and the playground show (docs/api.md, "Models").

The default is ``EPHEMERAL_DEFAULT_MODEL`` when set; otherwise a real model of the first
provider whose key is configured (:data:`PROVIDER_DEFAULTS`). With neither there is no
default, and a run that names no model is refused (422 naming ``model``) rather than answered
by a recording of another prompt. A run of an ``agent:`` program that names no model calls
none itself; it is recorded as :data:`NO_MODEL`, never under some default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from ephemeral.errors import ModelError, UnknownModel
from ephemeral.providers.base import ModelReply, Provider
from ephemeral.providers.registry import provider_for
from ephemeral.providers.replay import PREFIX as REPLAY_PREFIX
from ephemeral.providers.replay import cassette_path, load_cassette
from ephemeral.settings import Settings

if TYPE_CHECKING:
    from ephemeral.money.pricing import PriceBook

# (the Settings field of a provider key, the model a request naming none then gets)
PROVIDER_DEFAULTS: Final = (
    ("openai_api_key", "openai/gpt-4.1-mini"),
    ("anthropic_api_key", "anthropic/claude-sonnet-4-5"),
    ("openrouter_api_key", "openrouter/openai/gpt-4o-mini"),
)
# The model column of an agent run that named no model (its program may call models through
# the gateway, each call recorded with its own model); like a session's "(session)".
NO_MODEL: Final = "(none)"
MAX_LISTED_REPLAYS: Final = 200

HOW_TO: Final = (
    "name one (`model`, `--model`), or configure a default: set OPENAI_API_KEY, "
    "ANTHROPIC_API_KEY or OPENROUTER_API_KEY, or EPHEMERAL_DEFAULT_MODEL=provider/name; "
    "`replay/sandbox-proof` replays the product page's sample, and answers only its prompt "
    "(GET /v1/models lists what this server serves)"
)


class NoModelProvider:
    """The provider of an agent run that names no model: its program runs, our loop calls
    nothing (a call would be a bug, refused rather than sent anywhere)."""

    async def complete(self, **_: Any) -> ModelReply:
        raise ModelError("this run names no model; only its agent program runs")


def provider_of(model: str, settings: Settings) -> tuple[Provider, str]:
    """:func:`provider_for`, and for :data:`NO_MODEL` the provider that calls nothing."""
    if model == NO_MODEL:
        return NoModelProvider(), NO_MODEL
    return provider_for(model, settings)


NO_DEFAULT: Final = f"this server has no default model: {HOW_TO}"


def default_model(settings: Settings) -> str | None:
    """The model of a request that names none, or None when this host has no default."""
    if settings.default_model:
        return settings.default_model
    for field, model in PROVIDER_DEFAULTS:
        key = getattr(settings, field)
        if key is not None and key.get_secret_value():
            return model
    return None


def no_default() -> UnknownModel:
    message = f"no model named, and {NO_DEFAULT}"
    return UnknownModel(f"model: {message}", errors=[{"field": "model", "message": message}])


def resolve_model(model: str | None, settings: Settings, *, agent: bool = False) -> str:
    """The model a run records: the one it names, the default, or for an ``agent:`` run that
    names none, :data:`NO_MODEL`. Refused with :func:`no_default` when there is nothing."""
    if model:
        return model
    if agent:
        return NO_MODEL
    chosen = default_model(settings)
    if chosen is None:
        raise no_default()
    return chosen


def _replay_names(settings: Settings) -> list[str]:
    try:
        paths = sorted(settings.cassettes_dir.glob("*.json"))
    except OSError:
        return []
    return [REPLAY_PREFIX + p.stem for p in paths[:MAX_LISTED_REPLAYS]]


def usable_models(settings: Settings, book: PriceBook) -> list[dict[str, Any]]:
    """Every model a run here could use: priced, and its provider configured (a key, or a
    base URL of a local server) or, for a replay, its cassette readable in ``cassettes_dir``."""
    default = default_model(settings)
    listed: list[dict[str, Any]] = []
    for name in dict.fromkeys([*book.listed_models(), *_replay_names(settings)]):
        extra: dict[str, Any] = {}
        try:
            if name.startswith(REPLAY_PREFIX):
                path = cassette_path(settings.cassettes_dir, name.removeprefix(REPLAY_PREFIX))
                cassette = load_cassette(path)
                prompt = cassette.prompt
                extra = {
                    "replays": cassette.model,
                    "description": cassette.description,
                    "prompt": prompt if prompt is None or isinstance(prompt, str) else prompt[0],
                }
            else:
                provider_for(name, settings)
            price = book.model_price(name)
        except UnknownModel:
            continue  # its provider has no key here, its cassette is unreadable, or no price
        listed.append(
            {
                "id": name,
                "provider": name.partition("/")[0],
                "default": name == default,
                "price": price.model_dump(),
                **extra,
            }
        )
    return listed
