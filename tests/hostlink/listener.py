"""A host's channel listener in a process of its own, as ``ephemeral worker`` runs it (its
limits from the ``EPHEMERAL_LINK_*`` settings), for the flood test and bench/hostlink_flood.py.

    python -m tests.hostlink.listener

Prints one JSON line (``address``, ``instance``, ``pid``) once it listens, logs to stderr as a
worker does, and ends when its stdin closes. Its handler answers ``ping`` and ``stats`` (what
the listener holds and has turned away, and its descriptors and RSS as /proc says).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ephemeral.sessions.link import Limits, LinkServer
from ephemeral.settings import Settings

KEY = b"k" * 32
HOST = "a"
REPO = Path(__file__).resolve().parents[2]


def spawn(module: str, *args: str, **kw: Any) -> subprocess.Popen[str]:
    """``python -m module`` from the checkout (this listener, or the flood), at the default
    ``EPHEMERAL_LINK_*`` limits whatever the environment says."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPHEMERAL_LINK_")}
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        **kw,
    )


def usage(pid: int | str = "self") -> dict[str, int]:
    """A process's open descriptors and resident memory (this one by default)."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "rss": rss}


async def main() -> None:
    server: LinkServer

    async def handler(op: str, args: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        if op == "stats":
            return {
                "connections": server.connections,
                "refused": dict(server.refused),
                **usage(),
            }, b""
        return {"op": op}, b""

    server = LinkServer(KEY, HOST, handler, Limits.for_settings(Settings.load()))
    address = await server.start("127.0.0.1")
    print(json.dumps({"address": address, "instance": server.instance, "pid": os.getpid()}))
    sys.stdout.flush()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await server.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main())
