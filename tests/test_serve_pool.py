"""``ephemeral serve`` keeps a warm pool of two unless told otherwise, and 0 means none."""

from __future__ import annotations

import pytest

from ephemeral.cli.serve import DEFAULT_POOL, pool_size
from ephemeral.settings import Settings


@pytest.mark.parametrize(
    ("env", "flag", "expected"),
    [
        (None, None, DEFAULT_POOL),  # nothing said: the server's default
        ("0", None, 0),  # EPHEMERAL_POOL_SIZE=0 turns the pool off
        ("5", None, 5),
        ("5", 0, 0),  # the flag wins over the environment
        (None, 3, 3),
    ],
)
def test_pool_size(
    monkeypatch: pytest.MonkeyPatch, env: str | None, flag: int | None, expected: int
) -> None:
    if env is None:
        monkeypatch.delenv("EPHEMERAL_POOL_SIZE", raising=False)
    else:
        monkeypatch.setenv("EPHEMERAL_POOL_SIZE", env)
    assert pool_size(flag, Settings.load()) == expected
