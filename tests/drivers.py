"""Skips that cannot hide a missing driver: ``EPHEMERAL_TEST_REQUIRE_DRIVERS=gvisor,namespaces``.

A test whose sandbox driver cannot run on this host skips with the reason, unless the driver is
listed in ``EPHEMERAL_TEST_REQUIRE_DRIVERS`` (``.ci/run`` sets it): then it fails, so a green CI
run proves the required drivers really ran.
"""

from __future__ import annotations

import os
from typing import NoReturn, get_args

import pytest

from ephemeral.sandbox import images
from ephemeral.settings import Isolation, Settings

REQUIRE_ENV = "EPHEMERAL_TEST_REQUIRE_DRIVERS"
KNOWN = frozenset(get_args(Isolation)) - {"auto"}


def required() -> frozenset[str]:
    """The drivers this run must exercise; an unknown name is a usage error, not a no-op."""
    names = frozenset(n.strip() for n in os.environ.get(REQUIRE_ENV, "").split(",") if n.strip())
    unknown = names - KNOWN
    if unknown:
        raise pytest.UsageError(
            f"{REQUIRE_ENV}: unknown driver(s) {', '.join(sorted(unknown))}; "
            f"known: {', '.join(sorted(KNOWN))}"
        )
    return names


def unavailable(reason: str, *drivers: str) -> NoReturn:
    """Skip: ``drivers`` cannot run here. Fail instead when one of them is required.

    With no ``drivers`` the missing piece (the image, say) is needed by every driver.
    """
    needed = required() & set(drivers) if drivers else required()
    if needed:
        pytest.fail(
            f"{', '.join(sorted(needed))} required ({REQUIRE_ENV}) but cannot run here: {reason}",
            pytrace=False,
        )
    pytest.skip(reason)


def built_image(settings: Settings, name: str) -> images.ImageConfig:
    """The built image ``name``, or :func:`unavailable` (`make setup` builds the shipped ones)."""
    built = images.built_image(settings, name)
    if built is None:
        unavailable(f"image {name} not built (make setup)")
    return built
