"""EPHEMERAL_TEST_REQUIRE_DRIVERS turns a missing driver's skip into a failure."""

from __future__ import annotations

import pytest

from tests import drivers


def test_without_the_variable_a_missing_driver_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(drivers.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no runsc"):
        drivers.unavailable("no runsc", "gvisor")


def test_a_required_driver_that_cannot_run_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(drivers.REQUIRE_ENV, "gvisor, namespaces")
    with pytest.raises(pytest.fail.Exception, match=r"gvisor required .* no runsc"):
        drivers.unavailable("no runsc", "gvisor")
    with pytest.raises(pytest.fail.Exception, match="gvisor, namespaces required"):
        drivers.unavailable("no image")  # needed by every driver
    with pytest.raises(pytest.skip.Exception):
        drivers.unavailable("no qemu", "microvm-tcg")  # not required: still a skip


def test_a_misspelt_driver_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(drivers.REQUIRE_ENV, "gvisr")
    with pytest.raises(pytest.UsageError, match="gvisr"):
        drivers.required()
