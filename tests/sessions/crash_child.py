"""A process that opens a sandbox session, runs one command and waits to be SIGKILLed.

``python -m tests.sessions.crash_child STATE_DIR ISOLATION`` prints the session id when the
sandbox is up (tests/sessions/test_crash.py).
"""

from __future__ import annotations

import asyncio
import sys

from ephemeral.sessions.requests import ExecRequest, SessionRequest
from ephemeral.settings import Settings
from tests import runlevel


async def main(state_dir: str, isolation: str) -> None:
    settings = Settings.load(state_dir=state_dir, use_prefect=False)
    async with runlevel.started(settings, check=False) as runtime:  # SIGKILLed with it open
        org = await runtime.local_org()
        row, _ = await runtime.sessions.create(
            org, SessionRequest(isolation=isolation, timeout_seconds=300)
        )
        # a process left running in the sandbox (its output detached, so the exec returns at once)
        await runtime.sessions.exec(
            row.id, org, ExecRequest(command="sleep 1000 </dev/null >/dev/null 2>&1 &")
        )
        print(row.id, flush=True)
        await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
