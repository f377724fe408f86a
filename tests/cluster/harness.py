"""A scale-out cluster on one machine, from real processes (docs/deploy.md, "Scale-out").

One ``prefect server start`` (SQLite from the pre-migrated template: fastest here), one or more
``ephemeral serve`` with ``EPHEMERAL_EXECUTOR=dispatch`` and ``ephemeral worker`` processes, each
with its own state dir and ``EPHEMERAL_HOST_ID``, all sharing one store (``db_url``: PostgreSQL
in the tests), one records root and one seal key. Each process runs in its own session, so
``kill(name)`` takes its whole process tree, as a dead host would go; tests/watchdog.py takes
them all if the test process dies first (PostgreSQL and the Prefect server too). Used by
``tests/cluster/test_scaleout.py``, ``bench/scaleout.py`` and ``make cluster``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests import watchdog
from tests.evals.prefect_server import REPO, PrefectServer, free_port
from tests.patience import PATIENCE

EPHEMERAL = [sys.executable, "-m", "ephemeral.cli"]


class Cluster:
    def __init__(
        self,
        root: Path,
        db_url: str,
        *,
        lease_seconds: float = 30.0,
        isolation: str = "auto",
        extra_env: dict[str, str] | None = None,
        prefect_db_url: str | None = None,
        command: list[str] | None = None,
    ) -> None:
        from ephemeral.prefect_setup import ensure_template
        from ephemeral.settings import Settings

        self.root = root
        self.db_url = db_url
        self.lease_seconds = lease_seconds
        self.isolation = isolation
        self.extra_env = extra_env or {}
        self.command = command or EPHEMERAL  # bench/fake_sandboxes.py for the ceiling bench
        self.records = root / "records"
        self.seal_key = root / "seal.key"
        # Prefect on SQLite from the migrated template starts in seconds; on PostgreSQL
        # (``prefect_db_url``) its migrations take minutes, but no write waits for a lock.
        self.server = PrefectServer(
            root / "prefect",
            database_url=prefect_db_url,
            template=None if prefect_db_url else ensure_template(Settings.load()),
        )
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}
        self.api_url = ""  # the API process serving now (set by its user)
        self.api_key = ""

    # processes -------------------------------------------------------------------------------
    def state_dir(self, name: str) -> Path:
        return self.root / f"state-{name}"

    def env(self, name: str, **extra: str) -> dict[str, str]:
        state = self.state_dir(name)
        values = {
            "EPHEMERAL_STATE_DIR": str(state),
            "EPHEMERAL_DATABASE_URL": self.db_url,
            "EPHEMERAL_RECORDS_DIR": str(self.records),
            "EPHEMERAL_SEAL_KEY_FILE": str(self.seal_key),
            "EPHEMERAL_EXECUTOR": "dispatch",
            "EPHEMERAL_HOST_ID": name,
            "EPHEMERAL_LEASE_SECONDS": str(self.lease_seconds),
            "EPHEMERAL_ISOLATION": self.isolation,
            "PREFECT_HOME": str(state / "prefect"),
        }
        return self.server.env(**{**values, **self.extra_env, **extra})

    def spawn(self, name: str, *args: str, **extra: str) -> subprocess.Popen[bytes]:
        self.state_dir(name).mkdir(parents=True, exist_ok=True)
        log = self.root / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [*args],
                cwd=REPO,
                env=self.env(name, **extra),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        watchdog.watch(proc.pid)
        self.procs[name] = proc
        return proc

    def start(self) -> Cluster:
        self.root.mkdir(parents=True, exist_ok=True)
        self.server.start(timeout=150 if self.server.database_url is None else 400)
        return self

    def start_api(self, name: str = "api", port: int | None = None) -> str:
        port = port or free_port()
        self.ports[name] = port
        self.spawn(name, *self.command, "serve", "--port", str(port), "--pool", "0")
        url = f"http://127.0.0.1:{port}"
        self._wait(name, lambda: httpx.get(f"{url}/healthz", timeout=2).status_code == 200)
        return url

    def start_worker(self, host: str, *, limit: int = 4, pool: int = 1) -> None:
        log = self.root / f"{host}.log"
        start = log.stat().st_size if log.exists() else 0  # a restarted worker appends
        self.spawn(host, *self.command, "worker", "--limit", str(limit), "--pool", str(pool))
        self._wait(host, lambda: b"serving execute-run" in log.read_bytes()[start:])
        # That line comes before the worker's websocket subscribes: until the server lists it,
        # every task run goes to the other workers.
        line = log.read_bytes()[start:].split(b"serving execute-run")[1].split(b"\n")[0]
        client = line.rsplit(b" ", 1)[-1].decode()

        def subscribed() -> bool:
            workers = self.server.api("POST", "/task_workers/filter", json={})
            return client in {w["identifier"] for w in workers}

        self._wait(host, subscribed)

    def _wait(self, name: str, ready: Any, timeout: float = PATIENCE) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} exited: {self.tail(name)}")
            with contextlib.suppress(httpx.HTTPError, OSError):
                if ready():
                    return
            time.sleep(0.2)
        raise AssertionError(f"{name} not ready after {timeout} s: {self.tail(name)}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the process's whole tree (its session), then reap the leader."""
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
            os.killpg(proc.pid, signal.SIGKILL)
        watchdog.forget(proc.pid)

    def tail(self, name: str, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return (self.root / f"{name}.log").read_text(errors="replace")[-chars:]
        return ""

    def stop(self) -> None:
        for name in list(self.procs):  # workers and APIs first (SIGTERM: they clean up)
            self.kill(name, signal.SIGTERM)
        self.server.stop()

    # the store, as the admin CLI uses it ------------------------------------------------------
    def make_key(self, org: str, usd_micros: int) -> str:
        from ephemeral.store import Store

        async def go() -> str:
            store = await Store.open(self.db_url)
            try:
                made = await store.orgs.ensure(org)
                await store.orgs.credit(made.id, usd_micros, note="cluster")
                return (await store.keys.create(made.id, f"{org}@cluster.test"))[1]
            finally:
                await store.close()

        return asyncio.run(go())

    def org_reserved(self, org: str) -> int:
        """The org's open reservations (0 once every run has settled)."""
        from ephemeral.store import Store

        async def go() -> int:
            store = await Store.open(self.db_url)
            try:
                return (await store.orgs.get(org)).reserved_micros
            finally:
                await store.close()

        return asyncio.run(go())
