"""Money text: one exact rule for showing amounts, one exact parser for reading them."""

from __future__ import annotations

import pytest

from ephemeral.errors import InvalidRequest
from ephemeral.money.amounts import parse_usd, usd


@pytest.mark.parametrize(
    ("micros", "text"),
    [
        (40_000, "$0.04"),
        (3530, "$0.00353"),
        (0, "$0.00"),
        (1, "$0.000001"),
        (4, "$0.000004"),
        (10_000_000, "$10.00"),
        (10_000_250, "$10.00025"),
        (1_234_567_891, "$1234.567891"),
        (1_500_000, "$1.50"),
        (-3530, "-$0.00353"),
        (None, "-"),
    ],
)
def test_usd_is_exact_with_at_least_two_decimals(micros: int | None, text: str) -> None:
    assert usd(micros) == text


def test_a_signed_amount_shows_plus_for_a_rise() -> None:
    assert usd(200, signed=True) == "+$0.0002"
    assert usd(0, signed=True) == "+$0.00"
    assert usd(-200, signed=True) == "-$0.0002"


@pytest.mark.parametrize(
    ("text", "micros"),
    [
        ("0.04", 40_000),
        ("$0.04", 40_000),
        (" 0.04 ", 40_000),
        ("10", 10_000_000),
        ("$1.5", 1_500_000),
        (".5", 500_000),
        ("3.", 3_000_000),
        ("0.000001", 1),
        ("0.0000010", 1),
        ("1000000000", 10**15),
    ],
)
def test_parse_usd_is_exact(text: str, micros: int) -> None:
    assert parse_usd(text, field="--budget") == micros


@pytest.mark.parametrize("micros", [1, 3530, 40_000, 10_000_250, 1_234_567_891])
def test_what_usd_prints_parses_back(micros: int) -> None:
    assert parse_usd(usd(micros), field="x") == micros


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ten", "is not a dollar amount"),
        ("", "is not a dollar amount"),
        ("nan", "is not a dollar amount"),
        ("inf", "is not a dollar amount"),
        ("1e400000", "is not a dollar amount"),
        ("1,000", "is not a dollar amount"),
        ("$", "is not a dollar amount"),
        ("0.0000001", "more than 6 decimal places"),
        ("0", "must be more than $0"),
        ("-1", "must be more than $0"),
        ("1000000000.000001", "must be at most $1,000,000,000"),
    ],
)
def test_parse_usd_refuses_with_the_field_named(text: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_usd(text, field="--budget")
    [item] = info.value.errors or []
    assert item["field"] == "--budget"
    assert message in item["message"]


def test_negative_amounts_when_allowed() -> None:
    assert parse_usd("-2", field="--usd", positive=False) == -2_000_000
    assert parse_usd("-$2", field="--usd", positive=False) == -2_000_000
    assert parse_usd("0", field="--usd", positive=False) == 0
