"""Test harness root: one Prefect home per session, real state dirs per test.

Prefect reads its settings from the environment once, so the session's Prefect home is set in
``pytest_configure``, before any test module imports Prefect. Images and the pre-migrated
Prefect template live in the shared cache dir (``~/.cache/ephemeral``), built by ``make setup``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ephemeral.settings import Settings

pytest_plugins = ["tests.fixtures_pg"]

REPO = Path(__file__).resolve().parent.parent
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="ephemeral-tests-"))


def pytest_configure(config: pytest.Config) -> None:
    from ephemeral import prefect_setup
    from tests import drivers

    drivers.required()  # a typo in EPHEMERAL_TEST_REQUIRE_DRIVERS stops the run here

    os.environ["PREFECT_HOME"] = str(_SESSION_TMP / "prefect")
    prefect_setup.configure(Settings.load(state_dir=_SESSION_TMP / "state"))


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """Settings on a fresh state dir; Prefect off (the Prefect path has its own tests)."""
    return Settings.load(state_dir=tmp_path / "state", use_prefect=False)


@pytest.fixture
def cassettes(tmp_path: Path) -> Iterator[Path]:
    """A cassette dir holding the shipped cassettes, where a test can add its own."""
    d = tmp_path / "cassettes"
    shutil.copytree(REPO / "recipes" / "cassettes", d)
    yield d
