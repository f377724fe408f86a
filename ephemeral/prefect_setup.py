"""Prefect configured for offline, quiet, fast use; called by every entry point before Prefect
is imported.

Measured here (docs/design.md §8): an empty Prefect database costs ~16 s of migrations, so a
pre-migrated template per Prefect version is copied into each new ``PREFECT_HOME``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from ephemeral import errors
from ephemeral.settings import Settings

_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_LOGGING_TO_API_ENABLED": "false",
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "false",
}
# Only for the embedded server, which serves this process alone and no UI (Prefect starts it
# with the UI off): nobody reads its event feed, and automations (the reactive triggers and
# their actions) are a served-mode feature (docs/deploy.md). Persisting every event competed
# with flow-run creation for SQLite's one writer: measured, it was what a start waited on.
# Flow runs and task runs (the task-run recorder) are still recorded.
_EMBEDDED_DEFAULTS = {
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
}


def embedded() -> bool:
    """No ``PREFECT_API_URL``: Prefect starts its own server for this process (SQLite in the
    state dir, or ``prefect_database_url``), which this process alone uses."""
    return not os.environ.get("PREFECT_API_URL")


def template_path(settings: Settings) -> Path:
    return settings.cache_dir / f"prefect-{version('prefect')}.db"


def ensure_template(settings: Settings) -> Path:
    """A migrated, empty Prefect database for this Prefect version (built once, ~16 s)."""
    target = template_path(settings)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        env = {**os.environ, **_DEFAULTS, "PREFECT_HOME": tmp}
        env.pop("PREFECT_API_URL", None)
        env.pop("PREFECT_SERVER_DATABASE_CONNECTION_URL", None)
        subprocess.run(
            [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
            env=env,
            check=True,
            capture_output=True,
            timeout=300,
        )
        os.replace(Path(tmp) / "prefect.db", target)
    return target


def configure(settings: Settings) -> None:
    """Point Prefect at our state directory with offline defaults; the user's values win.
    (Entry points call :func:`ephemeral.flows.embedded_server.configure`, which also makes an
    embedded server end with their process.)"""
    home = settings.prefect_home
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(home))
    for key, value in _DEFAULTS.items():
        os.environ.setdefault(key, value)
    if settings.executor == "dispatch":
        if embedded():
            raise errors.InvalidRequest.field(
                "PREFECT_API_URL",
                "EPHEMERAL_EXECUTOR=dispatch hands runs to workers through one Prefect server; "
                "set PREFECT_API_URL to it (docs/deploy.md)",
            )
        # Prefect keeps a deferred task's parameters (a run id and its own context, never
        # content) in this storage; the API and every worker must share it. The records root
        # is shared already. A storage block (PREFECT_TASKS_SCHEDULING_DEFAULT_STORAGE_BLOCK)
        # replaces it, e.g. a bucket.
        os.environ.setdefault(
            "PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(settings.records_dir / "prefect-tasks")
        )
    if not embedded():
        return  # a real Prefect server: its database (and its TLS) are its own
    # The embedded server speaks plain HTTP on loopback, so no certificate is ever checked;
    # without this every Prefect client still parses the CA bundle (~45 ms, 3 per run).
    os.environ.setdefault("PREFECT_API_TLS_INSECURE_SKIP_VERIFY", "true")
    for key, value in _EMBEDDED_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if settings.prefect_database_url is not None:
        url = settings.prefect_database_url.get_secret_value()
        if not url.startswith("postgresql+asyncpg://"):
            raise errors.InvalidRequest.field(
                "prefect_database_url", "must be a postgresql+asyncpg:// URL"
            )
        # Prefect's server reads this; the subprocess it starts inherits it. Migrating an
        # empty database takes minutes here, so the start may wait that long once.
        os.environ.setdefault("PREFECT_SERVER_DATABASE_CONNECTION_URL", url)
        os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = str(
            max(600, int(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "0")))
        )
        return
    db = Path(os.environ["PREFECT_HOME"]) / "prefect.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    if not db.exists():
        shutil.copyfile(ensure_template(settings), db)
