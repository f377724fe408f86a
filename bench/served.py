"""What the API benches share: a real ``ephemeral serve`` subprocess, an org and key, SSE
following, percentiles, and CPU seconds per process from /proc.

Used by ``bench/soak.py``, ``bench/throughput.py`` and ``bench/tti.py``. Nothing here asserts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ephemeral.settings import Settings  # noqa: E402
from ephemeral.store import Store  # noqa: E402
from tests.sample import SAMPLE_PROMPT  # noqa: E402

SERVE = [sys.executable, "-m", "ephemeral.cli", "serve"]
# The product page's request with its recorded model: 3 model calls, 4 shell commands.
SEED_BODY: dict[str, Any] = {
    "prompt": SAMPLE_PROMPT,  # the one prompt replay/sandbox-proof answers
    "model": "replay/sandbox-proof",
    "web": False,
    "shell": True,
    "timeout_seconds": 120,
    "max_cost_micros": 40000,
}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def script_server(script: str, *args: str) -> tuple[subprocess.Popen[str], int]:
    """A Python ``script`` in a process of its own (an upstream, a relay) that prints the port it
    listens on as its first line; the process and that port."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def pct(values: list[float], p: float) -> float:
    """The nearest-rank percentile (NaN for no values)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))]


def trimmed(values: list[float], fraction: float = 0.05) -> list[float]:
    """The values less the top and bottom ``fraction`` (the public sandbox benchmark's trim)."""
    s = sorted(values)
    k = int(len(s) * fraction)
    return s[k : len(s) - k] if len(s) > 2 * k else s


def at(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_stats(pid: int) -> dict[str, float]:
    """RSS (MB), open fds and threads of one process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
    }


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


def prefect_server_pid(parent: int) -> int | None:
    """The embedded Prefect server that process ``parent`` started (a uvicorn child), if any."""
    for child in children(parent):
        with contextlib.suppress(OSError):
            if b"prefect.server" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
    return None


def proc_cpu(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of a process: utime+stime, cutime+cstime."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "
    own = (int(fields[11]) + int(fields[12])) / CLK_TCK
    reaped = (int(fields[13]) + int(fields[14])) / CLK_TCK
    return own, reaped


def machine_cpu() -> float:
    """Busy CPU seconds of the whole machine since boot (every core), from /proc/stat."""
    first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in first[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    url: str
    settings: Settings
    log: Path

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"server": proc_stats(self.proc.pid)}
        for child in children(self.proc.pid):
            with contextlib.suppress(OSError, KeyError):
                out[f"child {child}"] = proc_stats(child)
        return out

    def prefect_pid(self) -> int | None:
        """Prefect's embedded server: the uvicorn child that ``serve`` started."""
        return prefect_server_pid(self.proc.pid)

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: serve itself, its reaped children (the sandboxes), Prefect's
        server, this bench process and the machine."""
        serve_own, reaped = proc_cpu(self.proc.pid)
        prefect = self.prefect_pid()
        return {
            "serve": serve_own,
            "sandboxes": reaped,
            "prefect": proc_cpu(prefect)[0] if prefect else 0.0,
            "bench": self_cpu(),
            "machine": machine_cpu(),
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def background_cpu(seconds: float = 3.0) -> float:
    """The machine's busy CPU-s per second while nothing of ours runs: the floor under every
    machine-wide figure (other work shares this box)."""
    m0, t0 = machine_cpu(), time.monotonic()
    time.sleep(seconds)
    return (machine_cpu() - m0) / (time.monotonic() - t0)


async def make_key(settings: Settings, org: str = "bench", usd_micros: int = 10**10) -> str:
    store = await Store.open(settings.db_url)
    try:
        created = await store.orgs.create(org)
        await store.orgs.credit(created.id, usd_micros, note="bench")
        return (await store.keys.create(created.id, f"bench@{org}.test"))[1]
    finally:
        await store.close()


def serve(state: Path, *, pool: int, env: dict[str, str] | None = None) -> Served:
    """``ephemeral serve`` in its own session on a free loopback port; waits for /healthz."""
    port = free_port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("EPHEMERAL_")}
    full.update(
        {
            "EPHEMERAL_STATE_DIR": str(state),
            "EPHEMERAL_DEFAULT_MODEL": "replay/sandbox-proof",
            "PYTHONPATH": str(REPO),
            **(env or {}),
        }
    )
    log = state / "serve.log"
    state.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*SERVE, "--port", str(port), "--pool", str(pool)],
            cwd=REPO,
            env=full,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                settings = Settings.load(state_dir=state)
                return Served(proc=proc, url=url, settings=settings, log=log)
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"serve not healthy after 180 s: {log.read_text()[-3000:]}")


async def post_run(
    client: httpx.AsyncClient, body: dict[str, Any], key: str, attempts: int = 200
) -> tuple[dict[str, Any] | None, int]:
    """POST a run, honouring 429/503 with ``Retry-After``; (run object or None, 429s seen)."""
    throttled = 0
    for _ in range(attempts):
        try:
            r = await client.post("/v1/runs", json=body, headers={"Idempotency-Key": key})
        except httpx.TransportError:
            await asyncio.sleep(0.5)
            continue
        if r.status_code in (409, 429, 502, 503):
            throttled += r.status_code == 429
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
            continue
        r.raise_for_status()
        return r.json(), throttled
    return None, throttled


async def follow(
    client: httpx.AsyncClient, run_id: str, timeout: float = 600
) -> list[dict[str, Any]]:
    """The run's events from its SSE stream, until ``run.settled`` (or the stream ends).

    A stream the connection dropped (a saturated box) is finished by polling the JSON list: the
    figure measured is the server's, not this client's connection."""
    try:
        return await _follow(client, run_id, timeout)
    except httpx.TransportError:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                events = (await client.get(f"/v1/runs/{run_id}/events")).json()
                if events and events[-1]["type"] == "run.settled":
                    return list(events)
            await asyncio.sleep(0.5)
        raise


async def _follow(client: httpx.AsyncClient, run_id: str, timeout: float) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    async with client.stream(
        "GET",
        f"/v1/runs/{run_id}/events",
        headers={"Accept": "text/event-stream"},
        timeout=httpx.Timeout(timeout),
    ) as s:
        async for text in s.aiter_lines():
            if not text.startswith("data: "):
                continue
            ev: dict[str, Any] = json.loads(text[6:])
            events.append(ev)
            if ev["type"] == "run.settled":
                break
    return events


def event_at(events: list[dict[str, Any]], type_: str) -> datetime | None:
    ev = next((e for e in events if e["type"] == type_), None)
    return at(ev["at"]) if ev else None
