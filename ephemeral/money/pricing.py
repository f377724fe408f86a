"""The price book: what a model call, a web request and a second of sandbox cost, in micros.

Every figure is an integer number of micro-dollars, and every computed charge is rounded *up*
(a run is never undercharged by rounding). The shipped book is ``ephemeral/money/price_book.yaml``;
an operator file (``EPHEMERAL_PRICE_BOOK``) is laid over it: its model entries replace the
shipped ones by name, its ``web`` and ``compute`` fields replace single fields, and the
resulting version reads ``<shipped>+<override>`` so every record says which prices applied.

A model entry is either three prices or ``same_as: <other model>``. ``replay/<cassette>``
costs what the cassette's recorded model costs, unless the book lists it explicitly.
"""

from __future__ import annotations

import hashlib
import json
import math
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any, Final

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ephemeral.errors import InvalidRequest, UnknownModel
from ephemeral.providers.base import Message, ToolSpec, Usage
from ephemeral.providers.replay import PREFIX as REPLAY_PREFIX
from ephemeral.providers.replay import cassette_path, load_cassette
from ephemeral.settings import Settings

SHIPPED_PRICE_BOOK: Final = Path(__file__).with_name("price_book.yaml")
MTOK: Final = 1_000_000
_MAX_ALIAS_DEPTH: Final = 8
# libyaml's safe loader when present: ~10x faster than the pure-Python one.
_YAML_LOADER: Final = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ModelPrice(BaseModel):
    """Micros per million tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_per_mtok: int = Field(ge=0)
    output_per_mtok: int = Field(ge=0)
    cached_input_per_mtok: int = Field(ge=0)


class _ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_per_mtok: int | None = Field(default=None, ge=0)
    output_per_mtok: int | None = Field(default=None, ge=0)
    cached_input_per_mtok: int | None = Field(default=None, ge=0)
    same_as: str | None = None

    @model_validator(mode="after")
    def _prices_or_alias(self) -> _ModelEntry:
        prices = (self.input_per_mtok, self.output_per_mtok, self.cached_input_per_mtok)
        if self.same_as is not None:
            if any(p is not None for p in prices):
                raise ValueError("give either same_as or the three prices, not both")
        elif any(p is None for p in prices):
            raise ValueError(
                "needs input_per_mtok, output_per_mtok and cached_input_per_mtok (or same_as)"
            )
        return self


class _Web(BaseModel):
    model_config = ConfigDict(extra="forbid")
    per_request_micros: int = Field(ge=0)
    per_mib_micros: int = Field(default=0, ge=0)


class _Compute(BaseModel):
    model_config = ConfigDict(extra="forbid")
    per_vcpu_second_micros: int = Field(ge=0)
    per_gib_second_micros: int = Field(ge=0)


class _BookFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str = Field(min_length=1, max_length=64)
    models: dict[str, _ModelEntry]
    web: _Web
    compute: _Compute


class _WebPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    per_request_micros: int | None = Field(default=None, ge=0)
    per_mib_micros: int | None = Field(default=None, ge=0)


class _ComputePatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    per_vcpu_second_micros: int | None = Field(default=None, ge=0)
    per_gib_second_micros: int | None = Field(default=None, ge=0)


class _OverrideFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str | None = Field(default=None, min_length=1, max_length=64)
    models: dict[str, _ModelEntry] = Field(default_factory=dict)
    web: _WebPatch = Field(default_factory=_WebPatch)
    compute: _ComputePatch = Field(default_factory=_ComputePatch)


def _read_yaml(path: Path) -> tuple[Any, str]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRequest.field("price_book", f"cannot read {path}: {exc.strerror}") from None
    try:
        return yaml.load(text, Loader=_YAML_LOADER), text
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise InvalidRequest.field("price_book", f"{path}{where}: not valid YAML") from None


def _invalid(path: Path, exc: ValidationError) -> InvalidRequest:
    errors = [
        {
            "field": ".".join(["price_book", *(str(p) for p in e["loc"])]),
            "message": f"{path}: {e['msg']}",
        }
        for e in exc.errors()
    ]
    first = errors[0]
    return InvalidRequest(f"{first['field']}: {first['message']}", errors=errors)


class PriceBook:
    def __init__(
        self,
        *,
        version: str,
        models: dict[str, _ModelEntry],
        web: _Web,
        compute: _Compute,
        cassettes_dir: Path | None = None,
    ) -> None:
        self.version = version
        self._models = models
        self._web = web
        self._compute = compute
        self._cassettes_dir = cassettes_dir
        self._cassette_models: dict[str, tuple[tuple[int, int], str]] = {}
        for name in models:
            self._resolve(name)  # a dangling or cyclic same_as fails at load, not at a run

    @classmethod
    def load(cls, settings: Settings) -> PriceBook:
        return cls.from_files(
            SHIPPED_PRICE_BOOK, settings.price_book, cassettes_dir=settings.cassettes_dir
        )

    @classmethod
    def from_files(
        cls, shipped: Path, override: Path | None = None, *, cassettes_dir: Path | None = None
    ) -> PriceBook:
        doc, _ = _read_yaml(shipped)
        try:
            book = _BookFile.model_validate(doc)
        except ValidationError as exc:
            raise _invalid(shipped, exc) from None
        version = book.version
        models = dict(book.models)
        web = book.web.model_dump()
        compute = book.compute.model_dump()
        if override is not None:
            odoc, otext = _read_yaml(override)
            try:
                over = _OverrideFile.model_validate(odoc or {})
            except ValidationError as exc:
                raise _invalid(override, exc) from None
            models.update(over.models)
            web |= over.web.model_dump(exclude_none=True)
            compute |= over.compute.model_dump(exclude_none=True)
            tag = over.version or "sha256-" + hashlib.sha256(otext.encode()).hexdigest()[:12]
            version = f"{version}+{tag}"
        try:
            return cls(
                version=version,
                models=models,
                web=_Web.model_validate(web),
                compute=_Compute.model_validate(compute),
                cassettes_dir=cassettes_dir,
            )
        except UnknownModel as exc:
            message = exc.errors[0]["message"] if exc.errors else exc.detail
            raise InvalidRequest.field(
                "price_book.models", f"{override or shipped}: {message}"
            ) from None

    # --- lookups --------------------------------------------------------------------------

    def _resolve(self, model: str) -> ModelPrice | None:
        name = model
        for _ in range(_MAX_ALIAS_DEPTH):
            entry = self._models.get(name)
            if entry is None:
                if name != model:
                    raise _unknown(
                        model, f"{model!r} is priced same_as {name!r}, which is unlisted"
                    )
                return None
            if entry.same_as is None:
                return ModelPrice(
                    input_per_mtok=entry.input_per_mtok or 0,
                    output_per_mtok=entry.output_per_mtok or 0,
                    cached_input_per_mtok=entry.cached_input_per_mtok or 0,
                )
            name = entry.same_as
        raise _unknown(
            model, f"{model!r}: same_as chain is cyclic or deeper than {_MAX_ALIAS_DEPTH}"
        )

    def listed_models(self) -> list[str]:
        """The models the book names (its own entries; replays it does not list are not here)."""
        return sorted(self._models)

    def model_price(self, model: str) -> ModelPrice:
        price = self._resolve(model)
        if price is not None:
            return price
        if model.startswith(REPLAY_PREFIX) and self._cassettes_dir is not None:
            recorded = self._recorded_model(model.removeprefix(REPLAY_PREFIX))
            price = self._resolve(recorded)
            if price is not None:
                return price
            raise _unknown(
                model,
                f"{model!r} replays {recorded!r}, which has no price in price book "
                f"{self.version}; {_how_to_price(recorded)}",
            )
        raise _unknown(
            model,
            f"{model!r} has no price in price book {self.version}; {_how_to_price(model)}",
        )

    def _recorded_model(self, cassette: str) -> str:
        # The loop prices every turn; re-read a cassette only when its file changed.
        assert self._cassettes_dir is not None
        path = cassette_path(self._cassettes_dir, cassette)
        try:
            st = path.stat()
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None  # load_cassette below explains what is wrong
        cached = self._cassette_models.get(cassette)
        if stamp is not None and cached is not None and cached[0] == stamp:
            return cached[1]
        recorded = load_cassette(path).model
        if stamp is not None:
            self._cassette_models[cassette] = (stamp, recorded)
        return recorded

    def check_model(self, model: str) -> None:
        """Refuse, at admission, a model nobody could charge for."""
        self.model_price(model)

    # --- charges (integers only, rounded up) -----------------------------------------------

    def model_cost(self, model: str, usage: Usage) -> int:
        p = self.model_price(model)
        # input_tokens includes the cached ones; a provider claiming more cached than input
        # is clamped so it cannot make tokens cheaper than they were.
        cached = min(usage.cached_input_tokens, usage.input_tokens)
        numerator = (
            (usage.input_tokens - cached) * p.input_per_mtok
            + cached * p.cached_input_per_mtok
            + usage.output_tokens * p.output_per_mtok
        )
        return _ceil_div(numerator, MTOK)

    def worst_case(self, model: str, input_tokens: int, max_tokens: int) -> int:
        """The most a call can cost: every input token uncached, every output token used."""
        if input_tokens < 0:
            raise InvalidRequest.field("input_tokens", "must be >= 0")
        if max_tokens < 0:
            raise InvalidRequest.field("max_tokens", "must be >= 0")
        p = self.model_price(model)
        return _ceil_div(input_tokens * p.input_per_mtok + max_tokens * p.output_per_mtok, MTOK)

    def web_request_micros(self) -> int:
        return self._web.per_request_micros

    def web_mib_micros(self) -> int:
        """One MiB (either way) through the egress proxy."""
        return self._web.per_mib_micros

    def compute_micros(self, *, vcpu_seconds: float, gib_seconds: float) -> int:
        total = _exact(vcpu_seconds, "vcpu_seconds") * self._compute.per_vcpu_second_micros
        total += _exact(gib_seconds, "gib_seconds") * self._compute.per_gib_second_micros
        return math.ceil(total)


def _how_to_price(model: str) -> str:
    return (
        "to add it, write a YAML file with `models: {"
        f"{json.dumps(model)}: {{input_per_mtok: MICROS, output_per_mtok: MICROS, "
        "cached_input_per_mtok: MICROS}}` "
        "(micro-dollars per million tokens; 0 for a local model) and set "
        "EPHEMERAL_PRICE_BOOK to its path (docs/settings.md)"
    )


def _unknown(model: str, message: str) -> UnknownModel:
    return UnknownModel(f"model: {message}", errors=[{"field": "model", "message": message}])


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _exact(seconds: float, field: str) -> Fraction:
    # Through the shortest decimal repr, so 0.1 s is one tenth and not 0.1000000000000000055…,
    # which would round a whole charge up by a micro.
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise InvalidRequest.field(field, "must be a number of seconds")
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidRequest.field(field, "must be a finite number >= 0")
    return Fraction(Decimal(repr(seconds)))


# --- token estimate, for reserving before a call ----------------------------------------

_PER_REQUEST: Final = 16
_PER_MESSAGE: Final = 8
_PER_TOOL: Final = 16


def estimate_tokens(messages: list[Message], tools: list[ToolSpec]) -> int:
    """An upper estimate of the prompt's tokens without a tokenizer: UTF-8 bytes / 3 (real
    tokenizers average nearer 4 bytes per token for English and code) plus a fixed overhead
    per message, tool call and tool for the role markers and JSON framing."""
    total = _PER_REQUEST
    for m in messages:
        total += _PER_MESSAGE + _bytes_tokens(m.content or "")
        for tc in m.tool_calls:
            total += _PER_MESSAGE + _bytes_tokens(
                tc.id + tc.name + json.dumps(tc.arguments, ensure_ascii=False)
            )
        if m.tool_call_id:
            total += _bytes_tokens(m.tool_call_id)
    for t in tools:
        total += _PER_TOOL + _bytes_tokens(
            t.name + t.description + json.dumps(t.parameters, ensure_ascii=False)
        )
    return total


def _bytes_tokens(text: str) -> int:
    return _ceil_div(len(text.encode("utf-8")), 3)
