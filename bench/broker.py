"""What the broker adds to one outbound request: a ``web_fetch`` / ``connection_call`` through a
built run (checks, resolve, charge in SQLite, event append) vs a bare httpx GET to the same
local server. Prints percentiles; asserts nothing.

    .venv/bin/python bench/broker.py [--n 200]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx

from ephemeral.broker import Sealer
from ephemeral.policy import RunRequest
from ephemeral.providers.base import ToolCall
from ephemeral.service import Runtime
from ephemeral.settings import Settings
from tests.broker.conftest import Upstream, _handler


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[max(0, min(len(values) - 1, round(p / 100 * (len(values) - 1))))]


def show(label: str, ms: list[float]) -> None:
    print(
        f"{label:<22} n={len(ms):<4} p50={pct(ms, 50):7.2f} ms  p95={pct(ms, 95):7.2f} ms  "
        f"max={max(ms):7.2f} ms"
    )


async def main(n: int) -> None:
    up = Upstream()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(up))
    up.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings.load(
            state_dir=Path(tmp) / "state", use_prefect=False, broker_allow_private_hosts=True
        )
        runtime = await Runtime.start(settings)
        try:
            org = await runtime.local_org()
            await runtime.store.add_connection(
                org,
                "svc",
                base_url=f"{up.base}/api",
                header_names=["Authorization"],
                sealed_headers=Sealer.for_settings(settings).seal({"Authorization": "Bearer x"}),
            )
            request = RunRequest(
                prompt="bench",
                model="replay/sandbox-proof",
                web=True,
                shell=False,
                isolation="namespaces",
                max_cost_micros=100_000_000,
                connections=[{"name": "svc", "methods": ["GET"], "paths": ["/*"]}],
            )
            row, _ = await runtime.admit(org, request)
            agent = await runtime.build(row.id)

            bare: list[float] = []
            # A new connection per request, as the broker makes (keep-alive to http.server
            # hits the 40 ms delayed-ACK stall and would flatter the broker).
            async with httpx.AsyncClient(trust_env=False) as client:
                for _ in range(n):
                    t = time.perf_counter()
                    await client.get(f"{up.base}/text", headers={"Connection": "close"})
                    bare.append((time.perf_counter() - t) * 1000)
            results: dict[str, list[float]] = {"web_fetch": [], "connection_call": []}
            args = {
                "web_fetch": {"url": f"{up.base}/text?q=1"},
                "connection_call": {"name": "svc", "method": "GET", "path": "/echo"},
            }
            for i in range(n):
                for tool, times in results.items():
                    t = time.perf_counter()
                    await agent.tool_step(ToolCall(id=f"c{i}", name=tool, arguments=args[tool]))
                    times.append((time.perf_counter() - t) * 1000)
            show("bare httpx GET", bare)
            for tool, times in results.items():
                show(tool, times)
            charged = await runtime.store.charged(row.id)
            print(f"web charged: {charged['web_micros']} micros for {n} requests")
        finally:
            await runtime.close()
            server.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200)
    asyncio.run(main(parser.parse_args().n))
