"""A real PostgreSQL 15 (Debian's package) for the test session, as a pytest plugin.

Use it from a conftest: ``pytest_plugins = ["tests.fixtures_pg"]``. Fixtures:

- ``postgres_url``: session-scoped ``postgresql+asyncpg://…`` URL of a database shared by the
  session (tests must not assume it is empty).
- ``postgres_db_url``: a fresh, empty database per test (``CREATE DATABASE`` ~0.1 s).

The cluster lives in a temp directory, listens on 127.0.0.1 on a free port with fsync off, and
is stopped and deleted at the end of the session (by tests/watchdog.py if the test process dies
first: ``pg_ctl`` detaches the server). ``initdb`` refuses to run as root, so as root
every server command runs through ``runuser -u postgres``. Without the binaries (or, as root,
without the ``postgres`` user) the tests skip with the reason.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import watchdog

PG_BIN = Path(os.environ.get("EPHEMERAL_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
_SERVER_OPTS = (
    "-c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off "
    "-c full_page_writes=off -c max_connections=300 -c shared_buffers=64MB"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgCluster:
    """One throwaway cluster. ``start`` returns self; ``stop`` is idempotent."""

    def __init__(self) -> None:
        self.dir: Path | None = None
        self.port = 0
        self._as_postgres = os.geteuid() == 0
        self._counter = 0

    def _cmd(self, *args: str) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *args] if self._as_postgres else list(args)

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self._cmd(*args), capture_output=True, text=True, timeout=120, check=False
        )

    def unavailable(self) -> str | None:
        for tool in ("initdb", "pg_ctl", "psql"):
            if not (PG_BIN / tool).exists():
                return f"PostgreSQL binaries not found ({PG_BIN / tool}); apt install postgresql-15"
        if self._as_postgres:
            if shutil.which("runuser") is None:
                return "running as root and runuser is missing (initdb refuses root)"
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                return "running as root and there is no 'postgres' user (initdb refuses root)"
        return None

    def start(self) -> PgCluster:
        self.dir = Path(tempfile.mkdtemp(prefix="ephemeral-pg-"))
        watchdog.remove(self.dir)
        if self._as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.dir.chmod(0o700)
        init = self._run(
            str(PG_BIN / "initdb"),
            "-D",
            str(self.dir / "data"),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        )
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed: {init.stderr.strip()}")
        last = ""
        for _ in range(5):  # the free port can be taken between probing and binding
            self.port = _free_port()
            started = self._run(
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(self.dir / "data"),
                "-l",
                str(self.dir / "log"),
                "-o",
                f"-p {self.port} -k {self.dir} {_SERVER_OPTS}",
                "-w",
                "-t",
                "60",
                "start",
            )
            if started.returncode == 0:
                # SIGQUIT: the postmaster's immediate shutdown (`pg_ctl stop -m immediate`)
                watchdog.watch(self._postmaster(), signal.SIGQUIT)
                return self
            last = started.stderr.strip() + self._log_tail()
        raise RuntimeError(f"pg_ctl start failed: {last}")

    def _postmaster(self) -> int:
        """The server's pid (a session leader: ``pg_ctl`` calls setsid), from its pid file."""
        assert self.dir is not None
        return int((self.dir / "data" / "postmaster.pid").read_text().split()[0])

    def _log_tail(self) -> str:
        assert self.dir is not None
        with contextlib.suppress(OSError):
            return "\n" + (self.dir / "log").read_text()[-2000:]
        return ""

    def psql(self, sql: str, database: str = "postgres") -> str:
        out = subprocess.run(
            [
                str(PG_BIN / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-d",
                database,
                "-v",
                "ON_ERROR_STOP=1",
                "-tAc",
                sql,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"psql {sql!r} failed: {out.stderr.strip()}")
        return out.stdout.strip()

    def create_database(self, prefix: str = "test") -> str:
        self._counter += 1
        name = f"{prefix}_{os.getpid()}_{self._counter}_{int(time.time() * 1000) % 100000}"
        self.psql(f'CREATE DATABASE "{name}"')
        return name

    def url(self, database: str) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if self.dir is None:
            return
        if (self.dir / "data" / "postmaster.pid").exists():
            postmaster = self._postmaster()
            self._run(
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(self.dir / "data"),
                "-m",
                "immediate",
                "-w",
                "stop",
            )
            watchdog.forget(postmaster)
        shutil.rmtree(self.dir, ignore_errors=True)
        watchdog.keep(self.dir)
        self.dir = None


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PgCluster]:
    cluster = PgCluster()
    reason = cluster.unavailable()
    if reason:
        pytest.skip(reason)
    # The finalizer below is the normal path; atexit covers an interrupted session.
    atexit.register(cluster.stop)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def postgres_url(postgres_cluster: PgCluster) -> str:
    return postgres_cluster.url(postgres_cluster.create_database("shared"))


@pytest.fixture
def postgres_db_url(postgres_cluster: PgCluster) -> str:
    return postgres_cluster.url(postgres_cluster.create_database())
