"""A real ``prefect server start`` for a test, on 127.0.0.1, with its own PREFECT_HOME.

Every process started here runs in its own session and is killed by process group at stop,
so flow-run processes spawned by a worker go with it; and by tests/watchdog.py if the test
process dies first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests import watchdog

PREFECT = [sys.executable, "-m", "prefect"]
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrefectServer:
    def __init__(
        self, home: Path, *, database_url: str | None = None, template: Path | None = None
    ) -> None:
        self.home = home
        self.port = free_port()
        self.database_url = database_url
        self.template = template
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(
            {
                "PREFECT_HOME": str(self.home),
                "PREFECT_API_URL": self.api_url,
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "DO_NOT_TRACK": "1",
                "PREFECT_LOGGING_LEVEL": "WARNING",
                "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
                "PREFECT_UI_ENABLED": "false",
            }
        )
        if self.database_url:
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = self.database_url
        env.update(extra)
        return env

    def spawn(self, name: str, *args: str, **env: str) -> subprocess.Popen[bytes]:
        log = self.home / f"{name}.log"
        self.logs.append(log)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*args],
                cwd=REPO,
                env=self.env(**env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        watchdog.watch(proc.pid)
        self.procs.append(proc)
        return proc

    def start(self, timeout: float = 150) -> PrefectServer:
        self.home.mkdir(parents=True, exist_ok=True)
        if self.template is not None and self.database_url is None:
            shutil.copyfile(self.template, self.home / "prefect.db")
        server = self.spawn(
            "server",
            *PREFECT,
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--no-ui",
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise AssertionError(f"prefect server exited {server.returncode}: {self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.5)
        raise AssertionError(f"prefect server not healthy after {timeout} s: {self.tail()}")

    def prefect(self, *args: str, timeout: float = 120, **env: str) -> str:
        res = subprocess.run(
            [*PREFECT, "--no-prompt", *args],
            cwd=REPO,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert res.returncode == 0, f"prefect {' '.join(args)}: {res.stdout}{res.stderr}"
        return res.stdout

    def api(self, method: str, path: str, **kw: Any) -> Any:
        # A SQLite-backed Prefect server answers 503 while its database is locked; Prefect's own
        # client retries those (PREFECT_CLIENT_RETRY_EXTRA_CODES), and so does this raw helper.
        for attempt in range(5):
            res = httpx.request(method, f"{self.api_url}{path}", timeout=30, **kw)
            if res.status_code != 503:
                break
            time.sleep(0.5 * 2**attempt)
        assert res.status_code < 300, f"{method} {path}: {res.status_code} {res.text}"
        return res.json() if res.content else None

    def tail(self, chars: int = 4000) -> str:
        parts = []
        for log in self.logs:
            with contextlib.suppress(OSError):
                parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        for proc in reversed(self.procs):  # workers (and their flow runs) first, server last
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:  # a worker can ignore SIGTERM (research §3)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            # Children that outlived their leader still hold the group id.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            watchdog.forget(proc.pid)
        self.procs.clear()
