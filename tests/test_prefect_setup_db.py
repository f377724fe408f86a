"""The embedded Prefect server's database: SQLite from the template, or the PostgreSQL named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ephemeral import errors, prefect_setup
from ephemeral.settings import Settings

KEYS = (
    "PREFECT_HOME",
    "PREFECT_API_URL",
    "PREFECT_SERVER_DATABASE_CONNECTION_URL",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in KEYS:  # set first, so that the undo restores each as it was (or absent)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def test_postgres_replaces_the_sqlite_file(tmp_path: Path, clean_env: None) -> None:
    url = "postgresql+asyncpg://prefect:pw@127.0.0.1:5432/prefect"
    settings = Settings.load(state_dir=tmp_path / "state", prefect_database_url=url)
    prefect_setup.configure(settings)
    assert os.environ["PREFECT_SERVER_DATABASE_CONNECTION_URL"] == url
    assert int(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]) >= 600
    assert not (settings.prefect_home / "prefect.db").exists()
    assert "pw" not in repr(settings)  # a secret, as every other credential


def test_without_it_the_sqlite_template_is_copied(tmp_path: Path, clean_env: None) -> None:
    settings = Settings.load(state_dir=tmp_path / "state")
    prefect_setup.configure(settings)
    assert "PREFECT_SERVER_DATABASE_CONNECTION_URL" not in os.environ
    assert (settings.prefect_home / "prefect.db").exists()


def test_only_asyncpg_urls(tmp_path: Path, clean_env: None) -> None:
    settings = Settings.load(state_dir=tmp_path / "s", prefect_database_url="postgresql://x/y")
    with pytest.raises(errors.InvalidRequest) as info:
        prefect_setup.configure(settings)
    assert "prefect_database_url" in str(info.value.detail) or info.value.errors
