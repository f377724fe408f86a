"""Money on screen and on the command line: integer micro-dollars in, dollars out, and back.

Amounts are integer micro-dollars everywhere (1 USD = 1,000,000; never floats). This module is
the one place that turns them into text and text into them, so every page, table, report and
error message shows an amount the same way:

* :func:`usd` is exact and short: at least two decimals, more only when the micro-dollars need
  them (at most six), the sign before the dollar sign: ``$0.04``, ``$0.00353``, ``$12.50``,
  ``$0.000001``, ``-$1.50``; ``+$0.0002`` with ``signed=True`` (a change); ``-`` for unknown.
* :func:`parse_usd` reads what a person types (``0.04``, ``$0.04``, ``-2`` when negatives are
  allowed) exactly, or raises :class:`~ephemeral.errors.InvalidRequest` naming the field.
"""

from __future__ import annotations

import re

from ephemeral import errors

MICROS_PER_USD = 1_000_000
MAX_USD = 1_000_000_000
# Plain decimal notation only: no exponent, no inf/nan, no thousands separators.
_AMOUNT = re.compile(r"^([+-]?)\$?(\d+)(?:\.(\d*))?$|^([+-]?)\$?\.(\d+)$")


def usd(micros: int | None, *, signed: bool = False) -> str:
    """``3530`` → ``$0.00353``; ``40_000`` → ``$0.04``; ``None`` → ``-`` (not known yet)."""
    if micros is None:
        return "-"
    sign = "-" if micros < 0 else ("+" if signed else "")
    whole, frac = divmod(abs(micros), MICROS_PER_USD)
    decimals = f"{frac:06d}".rstrip("0").ljust(2, "0")
    return f"{sign}${whole}.{decimals}"


def parse_usd(text: str, *, field: str, positive: bool = True) -> int:
    """``"0.04"`` or ``"$0.04"`` → ``40_000``, exactly; at most 6 decimals and $1,000,000,000.

    ``positive=False`` also accepts zero and negative amounts (a debit).
    """
    match = _AMOUNT.match(text.strip())
    if match is None:
        raise errors.InvalidRequest.field(
            field, f"{text!r} is not a dollar amount (write it like 0.04 or $0.04)"
        )
    if match.group(2) is not None:
        sign, whole, frac = match.group(1), match.group(2), match.group(3) or ""
    else:
        sign, whole, frac = match.group(4), "0", match.group(5)
    if len(frac.rstrip("0")) > 6:
        raise errors.InvalidRequest.field(
            field, "has more than 6 decimal places (the smallest amount is $0.000001)"
        )
    micros = int(whole) * MICROS_PER_USD + int(frac.rstrip("0").ljust(6, "0"))
    if sign == "-":
        micros = -micros
    if abs(micros) > MAX_USD * MICROS_PER_USD:
        raise errors.InvalidRequest.field(field, "must be at most $1,000,000,000")
    if positive and micros <= 0:
        raise errors.InvalidRequest.field(field, "must be more than $0")
    return micros
