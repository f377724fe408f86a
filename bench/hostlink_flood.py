"""Host link under a connection flood: signed ping latency, quiet and flooded (no asserts).

    .venv/bin/python bench/hostlink_flood.py [--n 300] [--connections 20000] [--sources 40]

A channel listener in its own process at the default ``EPHEMERAL_LINK_*`` limits
(tests/hostlink/listener.py). Quiet: ``--n`` signed pings on one pooled connection, and ``--n``
on a fresh connection each. Flooded: the same while tests/hostlink/flood.py, in another
process, keeps up to ``--connections`` connections without the key open from ``--sources``
loopback addresses, re-opening them without pause (one in 50 with a nested or a slow header);
measured once its first wave is open. Prints p50/p99/max of each, the listener's most
descriptors and RSS seen (sampled after every ping) and what it turned away.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from typing import Any

from ephemeral.sessions.link import LinkClient, Peer
from tests.hostlink import listener
from tests.hostlink.listener import spawn


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


class Usage:
    """The listener's most descriptors and resident memory seen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fds = 0
        self.rss = 0

    def sample(self) -> None:
        now = listener.usage(self.pid)
        self.fds = max(self.fds, now["fds"])
        self.rss = max(self.rss, now["rss"])


async def pings(peer: Peer, n: int, usage: Usage) -> dict[str, list[float]]:
    """Milliseconds per signed ping: on one pooled connection, and on a fresh one each."""
    out: dict[str, list[float]] = {"pooled": [], "fresh": [], "failed": []}
    pooled = LinkClient(listener.KEY, "bench")
    await pooled.call(peer, "ping", {}, timeout=10)
    try:
        for _ in range(n):
            for kind in ("pooled", "fresh"):
                client = pooled if kind == "pooled" else LinkClient(listener.KEY, "bench")
                t0 = time.perf_counter()
                try:
                    await client.call(peer, "ping", {}, timeout=10)
                    out[kind].append((time.perf_counter() - t0) * 1000)
                except Exception:
                    out["failed"].append((time.perf_counter() - t0) * 1000)
                if client is not pooled:
                    await client.close()
                usage.sample()
    finally:
        await pooled.close()
    return out


def show(name: str, got: dict[str, list[float]]) -> None:
    for kind in ("pooled", "fresh"):
        xs = got[kind]
        print(
            f"{name:8} {kind:6} n={len(xs):4}  p50 {pct(xs, 50):7.2f} ms  "
            f"p99 {pct(xs, 99):8.2f} ms  max {max(xs):8.2f} ms"
        )
    print(f"{name:8} failed {len(got['failed'])}")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--connections", type=int, default=20_000)
    ap.add_argument("--sources", type=int, default=40)
    args = ap.parse_args()
    host = spawn("tests.hostlink.listener")
    assert host.stdout is not None
    info = json.loads(host.stdout.readline())
    peer = Peer(listener.HOST, info["address"], info["instance"])
    usage = Usage(info["pid"])
    flood: subprocess.Popen[str] | None = None
    try:
        quiet = await pings(peer, args.n, usage)
        quiet_usage = (usage.fds, usage.rss)
        flood = spawn(
            "tests.hostlink.flood",
            info["address"],
            "--connections",
            str(args.connections),
            "--sources",
            str(args.sources),
            "--waves",
            "1000000",
        )
        assert flood.stdout is not None
        t0 = time.monotonic()
        first = await asyncio.to_thread(flood.stdout.readline)  # its first wave is open
        print(f"flood: {first.strip()} in {time.monotonic() - t0:.1f} s; it goes on")
        flooded = await pings(peer, args.n, usage)
        asking = LinkClient(listener.KEY, "bench")
        stats: dict[str, Any] = (await asking.call(peer, "stats", {}, timeout=10))[0]
        await asking.close()
    finally:
        if flood is not None:
            flood.kill()
            flood.wait()
        host.stdin.close()  # type: ignore[union-attr]
        host.wait(60)
    show("quiet", quiet)
    show("flooded", flooded)
    print(f"listener quiet:   most fds {quiet_usage[0]}, RSS {quiet_usage[1] / 2**20:.1f} MiB")
    print(f"listener flooded: most fds {usage.fds}, RSS {usage.rss / 2**20:.1f} MiB")
    print(f"held at the end: {stats['connections']} connections; turned away: {stats['refused']}")


if __name__ == "__main__":
    asyncio.run(main())
