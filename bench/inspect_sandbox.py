"""Inspect AI benchmark: sample start and exec round trip, ephemeral vs baselines (no asserts).

    .venv/bin/python bench/inspect_sandbox.py [--isolation gvisor] [--n 20]

(Not bench/inspect.py: run as a script, that name would shadow the standard library's
``inspect`` module, which asyncio imports.)

1. Inspect sample start (``sample_init`` of the provider, what Inspect awaits before a sample
   runs) with the ``ephemeral`` provider in process, warm (the pool refilled between samples)
   and cold (no pool), next to Inspect's own ``local`` provider in the same run. ``docker`` is
   not installed on this machine, so Inspect's docker provider is not measured.
2. Exec round trip of ``true`` in one session: through the session API over real HTTP
   (uvicorn on 127.0.0.1, ``EPHEMERAL_URL`` backend) vs in process (``runtime.sessions.exec``),
   and the provider's ``exec`` on each, next to the local provider's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from inspect_ai.util import SandboxEnvironment
from inspect_ai.util._sandbox.local import LocalSandboxEnvironment

from ephemeral.engine.runtime import Runtime
from ephemeral.inspect_provider import EphemeralSandboxConfig, EphemeralSandboxEnvironment
from ephemeral.inspect_provider.provider import BACKENDS
from ephemeral.sessions.requests import ExecRequest, SessionRequest
from ephemeral.settings import Settings


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def line(label: str, xs: list[float], base: list[float] | None = None) -> str:
    text = f"  {label:<44} " + " ".join(f"p{p:g}={pct(xs, p):8.2f}ms" for p in (50, 90, 99))
    if base:
        text += f"   x{statistics.median(xs) / statistics.median(base):6.1f} of baseline p50"
    return text + f"  (n={len(xs)})"


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return (time.perf_counter() - t0) * 1000


async def local_starts(n: int) -> list[float]:
    out = []
    for i in range(n):
        task = f"bench-local-{i}"
        await LocalSandboxEnvironment.task_init(task, None)
        t0 = time.perf_counter()
        envs = await LocalSandboxEnvironment.sample_init(task, None, {})
        out.append((time.perf_counter() - t0) * 1000)
        await LocalSandboxEnvironment.sample_cleanup(task, None, envs, False)
    return out


async def ephemeral_starts(n: int, config: EphemeralSandboxConfig) -> list[float]:
    out = []
    await EphemeralSandboxEnvironment.task_init("bench", config)
    backend, _ = await BACKENDS.get(config)
    pool = next(iter(getattr(backend, "runtime").sandboxes.pools.values()), None)  # noqa: B009
    for _ in range(n):
        if pool is not None:
            await pool.wait_ready(120)  # each sample takes a warm one
        t0 = time.perf_counter()
        envs = await EphemeralSandboxEnvironment.sample_init("bench", config, {})
        out.append((time.perf_counter() - t0) * 1000)
        await EphemeralSandboxEnvironment.sample_cleanup("bench", config, envs, False)
    await EphemeralSandboxEnvironment.task_cleanup("bench", config, True)
    return out


async def provider_execs(env: SandboxEnvironment, n: int) -> list[float]:
    await env.exec(["true"])
    return [await timed(lambda: env.exec(["true"])) for _ in range(n)]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isolation", default="gvisor")
    ap.add_argument("--n", type=int, default=20)
    args = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="ephemeral-bench-inspect-"))
    os.environ["EPHEMERAL_STATE_DIR"] = str(state)
    os.environ.pop("EPHEMERAL_URL", None)
    print(f"bench/inspect_sandbox.py · isolation={args.isolation} · n={args.n}")
    print("  docker: not installed on this machine (Inspect's docker provider not measured)")
    try:
        print("1. Inspect sample start (sample_init)")
        local = await local_starts(args.n)
        print(line("local provider (a temp dir, baseline)", local))
        warm = await ephemeral_starts(
            args.n, EphemeralSandboxConfig(isolation=args.isolation, pool_size=2)
        )
        print(line(f"ephemeral {args.isolation}, warm pool", warm, local))
        cold = await ephemeral_starts(
            max(5, args.n // 2), EphemeralSandboxConfig(isolation=args.isolation, pool_size=0)
        )
        print(line(f"ephemeral {args.isolation}, cold (no pool)", cold, local))

        print("2. exec round trip of `true`")
        settings = Settings.load(state_dir=state / "inproc", use_prefect=False)
        runtime = await Runtime.start(settings)
        try:
            org = await runtime.local_org()
            row, _ = await runtime.sessions.create(
                org, SessionRequest(isolation=args.isolation, timeout_seconds=600)
            )
            req = ExecRequest(command=["true"])
            await runtime.sessions.exec(row.id, org, req)
            inproc = [
                await timed(lambda: runtime.sessions.exec(row.id, org, req))
                for _ in range(args.n * 2)
            ]
            await runtime.sessions.end(row.id, org)
        finally:
            await runtime.close()
        print(line("in process (runtime.sessions.exec)", inproc))
        http = await http_execs(state, args)
        print(line("session API over HTTP (client.sandboxes.exec)", http, inproc))

        envs = await LocalSandboxEnvironment.sample_init("bench-x", None, {})
        local_x = await provider_execs(envs["default"], args.n * 2)
        await LocalSandboxEnvironment.sample_cleanup("bench-x", None, envs, False)
        print(line("Inspect local provider exec (a host process)", local_x))
        config = EphemeralSandboxConfig(isolation=args.isolation, pool_size=0)
        await EphemeralSandboxEnvironment.task_init("bench-x", config)
        envs = await EphemeralSandboxEnvironment.sample_init("bench-x", config, {})
        eph_x = await provider_execs(envs["default"], args.n * 2)
        await EphemeralSandboxEnvironment.sample_cleanup("bench-x", config, envs, False)
        await EphemeralSandboxEnvironment.task_cleanup("bench-x", config, True)
        print(line(f"ephemeral provider exec, in process ({args.isolation})", eph_x, local_x))
    finally:
        shutil.rmtree(state, ignore_errors=True)


async def http_execs(state: Path, args: argparse.Namespace) -> list[float]:
    """The same exec through a real server: uvicorn in a thread, the client on this loop."""
    import uvicorn

    from ephemeral.api import create_app
    from ephemeral.client import AsyncClient
    from ephemeral.store import Store

    settings = Settings.load(state_dir=state / "server", use_prefect=False)
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings, warm_pool=False), host="127.0.0.1", port=0,
                       log_level="warning")
    )  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        await asyncio.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    store = await Store.open(settings.db_url)
    try:
        org = await store.orgs.create("bench")
        await store.orgs.credit(org.id, 10_000_000, note="bench")
        _, key = await store.keys.create(org.id, "bench@bench.test")
    finally:
        await store.close()
    try:
        async with AsyncClient(base_url=url, api_key=key) as client:
            sbx = await client.sandboxes.create(isolation=args.isolation, timeout_seconds=600)
            await client.sandboxes.exec(sbx["id"], ["true"])
            out = [
                await timed(lambda: client.sandboxes.exec(sbx["id"], ["true"]))
                for _ in range(args.n * 2)
            ]
            await client.sandboxes.delete(sbx["id"])
            return out
    finally:
        server.should_exit = True
        thread.join(30)


if __name__ == "__main__":
    asyncio.run(main())
