"""The price book: integer micros, rounded up, unknown models refused, operator overrides."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from ephemeral.errors import InvalidRequest, UnknownModel
from ephemeral.money.pricing import SHIPPED_PRICE_BOOK, PriceBook, estimate_tokens
from ephemeral.providers.base import Message, ToolCall, Usage
from ephemeral.settings import Settings

from .conftest import SHELL

BOOK = PriceBook.from_files(SHIPPED_PRICE_BOOK)
LUNA = "openai/gpt-6-luna"


def test_shipped_book_is_versioned_and_prices_the_sample() -> None:
    book = PriceBook.load(Settings.load())
    assert book.version == "2026-12-01"
    # the product page: 3 calls, 4,800 in + 414 out -> $0.00033; ~4 s of 1 vCPU + 0.5 GiB
    calls = [(1360, 61), (1510, 149), (1930, 204)]
    assert (
        sum(book.model_cost(LUNA, Usage(input_tokens=i, output_tokens=o)) for i, o in calls) == 330
    )
    assert book.compute_micros(vcpu_seconds=4.0, gib_seconds=2.0) == 3200
    assert book.web_request_micros() > 0
    assert book.model_price("replay/sandbox-proof") == book.model_price(LUNA)


def test_every_shipped_model_has_a_provider_prefix() -> None:
    doc = yaml.safe_load(SHIPPED_PRICE_BOOK.read_text())
    for name in doc["models"]:
        assert name.split("/", 1)[0] in {"openai", "anthropic", "openrouter", "replay"}, name
        BOOK.check_model(name)


def test_rounds_up_never_down() -> None:
    assert BOOK.model_cost(LUNA, Usage()) == 0
    assert BOOK.model_cost(LUNA, Usage(input_tokens=1)) == 1  # 0.045 micros -> 1
    assert BOOK.model_cost(LUNA, Usage(output_tokens=4)) == 2  # 1.1 -> 2
    assert BOOK.worst_case(LUNA, 1, 0) == 1
    assert BOOK.compute_micros(vcpu_seconds=0.001, gib_seconds=0) == 1  # 0.7 -> 1
    # exact decimal seconds: 0.1 s is 70 micros, not 71 from binary float noise
    assert BOOK.compute_micros(vcpu_seconds=0.1, gib_seconds=0.0) == 70
    assert BOOK.compute_micros(vcpu_seconds=3, gib_seconds=1.5) == 2100 + 300


def test_cached_tokens_are_cheaper_and_clamped_to_the_input() -> None:
    full = BOOK.model_cost("openai/gpt-4o", Usage(input_tokens=1_000_000))
    cached = BOOK.model_cost(
        "openai/gpt-4o", Usage(input_tokens=1_000_000, cached_input_tokens=1_000_000)
    )
    assert (full, cached) == (2_500_000, 1_250_000)
    liar = BOOK.model_cost("openai/gpt-4o", Usage(input_tokens=10, cached_input_tokens=10**9))
    assert liar == BOOK.model_cost("openai/gpt-4o", Usage(input_tokens=10, cached_input_tokens=10))


models = st.sampled_from(["openai/gpt-6-luna", "openai/gpt-4o", "anthropic/claude-opus-4-1"])
counts = st.integers(min_value=0, max_value=10**9)


@given(models, counts, counts, counts)
def test_model_cost_is_the_exact_price_rounded_up(model: str, i: int, o: int, c: int) -> None:
    usage = Usage(input_tokens=i, output_tokens=o, cached_input_tokens=min(c, i))
    p = BOOK.model_price(model)
    exact = Fraction(
        (i - usage.cached_input_tokens) * p.input_per_mtok
        + usage.cached_input_tokens * p.cached_input_per_mtok
        + o * p.output_per_mtok,
        1_000_000,
    )
    cost = BOOK.model_cost(model, usage)
    assert type(cost) is int
    assert exact <= cost < exact + 1


@given(models, counts, counts, st.integers(min_value=0, max_value=10**6))
def test_worst_case_covers_any_call_within_its_limits(
    model: str, est_in: int, actual_out: int, slack: int
) -> None:
    max_tokens = actual_out + slack
    usage = Usage(input_tokens=est_in, output_tokens=actual_out, cached_input_tokens=est_in // 2)
    assert BOOK.worst_case(model, est_in, max_tokens) >= BOOK.model_cost(model, usage)


def test_unknown_model_is_refused_naming_the_field(tmp_path: Path) -> None:
    book = PriceBook.load(Settings.load(cassettes_dir=tmp_path))
    for model in ["openai/gpt-nope", "mystery", "replay/absent"]:
        with pytest.raises(UnknownModel) as info:
            book.check_model(model)
        assert info.value.errors and info.value.errors[0]["field"] == "model"
        with pytest.raises(UnknownModel):
            book.model_cost(model, Usage(input_tokens=1))
        with pytest.raises(UnknownModel):
            book.worst_case(model, 1, 1)


def test_the_refusal_says_how_to_price_the_model_and_the_advice_works(tmp_path: Path) -> None:
    book = PriceBook.load(Settings.load(cassettes_dir=tmp_path))
    with pytest.raises(UnknownModel) as info:
        book.check_model("local/qwen-7b")
    message = info.value.errors[0]["message"]
    assert "EPHEMERAL_PRICE_BOOK" in message
    # The YAML the message suggests, with the placeholders filled in, prices the model.
    snippet = message.split("`")[1].replace("MICROS", "0")
    priced = _override(tmp_path, snippet)
    assert priced.model_cost("local/qwen-7b", Usage(input_tokens=1000, output_tokens=10)) == 0


def test_replay_of_an_unpriced_recorded_model_is_refused(tmp_path: Path) -> None:
    (tmp_path / "odd.json").write_text(
        '{"version": 1, "model": "openai/unpriced", "recorded_at": "t", "turns": []}'
    )
    book = PriceBook.load(Settings.load(cassettes_dir=tmp_path))
    with pytest.raises(UnknownModel, match="openai/unpriced"):
        book.check_model("replay/odd")


def _override(tmp_path: Path, text: str) -> PriceBook:
    path = tmp_path / "prices.yaml"
    path.write_text(text)
    return PriceBook.load(Settings.load(price_book=path, cassettes_dir=tmp_path))


def test_operator_override_overlays_the_shipped_book(tmp_path: Path) -> None:
    book = _override(
        tmp_path,
        """
version: acme-7
models:
  openai/gpt-6-luna: {input_per_mtok: 1, output_per_mtok: 2, cached_input_per_mtok: 0}
  openai/llama-3.1-8b-instruct: {input_per_mtok: 0, output_per_mtok: 0, cached_input_per_mtok: 0}
  openai/house-alias: {same_as: openai/gpt-4o}
web: {per_request_micros: 5}
""",
    )
    assert book.version == "2026-12-01+acme-7"
    assert book.model_price(LUNA).output_per_mtok == 2
    assert book.model_price("replay/sandbox-proof").output_per_mtok == 2  # follows the alias
    assert book.model_cost("openai/llama-3.1-8b-instruct", Usage(input_tokens=10**6)) == 0
    assert book.model_price("openai/house-alias") == BOOK.model_price("openai/gpt-4o")
    assert book.model_price("anthropic/claude-haiku-4-5") == BOOK.model_price(
        "anthropic/claude-haiku-4-5"
    )
    assert book.web_request_micros() == 5
    assert book.compute_micros(vcpu_seconds=1, gib_seconds=0) == 700  # untouched


def test_override_without_version_gets_a_content_hash(tmp_path: Path) -> None:
    a = _override(tmp_path, "compute: {per_vcpu_second_micros: 1}\n")
    b = _override(tmp_path, "compute: {per_vcpu_second_micros: 2}\n")
    assert a.version.startswith("2026-12-01+sha256-")
    assert a.version != b.version


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (
            "models: {openai/x: {input_per_mtok: -1, output_per_mtok: 1,"
            " cached_input_per_mtok: 1}}",
            "price_book.models.openai/x.input_per_mtok",
        ),
        ("models: {openai/x: {input_per_mtok: 1}}", "price_book.models.openai/x"),
        (
            "models: {openai/x: {input_per_mtok: 1.5, output_per_mtok: 1,"
            " cached_input_per_mtok: 1}}",
            "price_book.models.openai/x.input_per_mtok",
        ),
        ("web: {per_request_micros: -3}", "price_book.web.per_request_micros"),
        ("colour: blue", "price_book.colour"),
        ("models: {openai/x: {same_as: openai/nowhere}}", "price_book.models"),
        (
            "models: {openai/a: {same_as: openai/b}, openai/b: {same_as: openai/a}}",
            "price_book.models",
        ),
        ("models: [unclosed", "price_book"),
    ],
)
def test_bad_override_is_refused_naming_the_field(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        _override(tmp_path, text)
    assert info.value.errors and info.value.errors[0]["field"] == field
    assert "prices.yaml" in info.value.detail


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_compute_refuses_nonsense_seconds(bad: float) -> None:
    with pytest.raises(InvalidRequest) as info:
        BOOK.compute_micros(vcpu_seconds=bad, gib_seconds=0)
    assert info.value.errors and info.value.errors[0]["field"] == "vcpu_seconds"


def test_estimate_tokens_is_conservative_and_grows() -> None:
    prompt = "This is a sandbox test. Do these steps with the shell and report the real output."
    base = estimate_tokens([Message(role="user", content=prompt)], [])
    # real tokenizers give ~1 token per 4 bytes of English; we must not be below that
    assert base >= len(prompt) / 4
    with_tool = estimate_tokens([Message(role="user", content=prompt)], [SHELL])
    assert with_tool > base
    call = Message(
        role="assistant",
        tool_calls=[ToolCall(id="c", name="shell", arguments={"command": "ls -la /tmp " * 20})],
    )
    assert estimate_tokens([Message(role="user", content=prompt), call], []) > base + 60
    assert estimate_tokens([], []) > 0
    # non-ASCII: UTF-8 bytes, so a CJK character counts as a whole token
    assert estimate_tokens([Message(role="user", content="沙" * 300)], []) >= 300


def test_rerecorded_cassette_is_priced_as_its_new_model(tmp_path: Path) -> None:
    def record(model: str) -> None:
        (tmp_path / "mine.json").write_text(
            f'{{"version": 1, "model": "{model}", "recorded_at": "t", "turns": []}}'
        )

    book = PriceBook.load(Settings.load(cassettes_dir=tmp_path))
    record("openai/gpt-4o")
    assert book.model_price("replay/mine") == BOOK.model_price("openai/gpt-4o")
    record("anthropic/claude-opus-4-1")
    assert book.model_price("replay/mine") == BOOK.model_price("anthropic/claude-opus-4-1")
    (tmp_path / "mine.json").unlink()
    with pytest.raises(UnknownModel, match="no cassette"):
        book.check_model("replay/mine")
