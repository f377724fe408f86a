"""Start ``hostile_agent.py`` (a scripted lying guest agent) behind the real host side."""

from __future__ import annotations

import sys
from pathlib import Path

from ephemeral.sandbox import handles
from ephemeral.sandbox.base import Limits
from ephemeral.sandbox.process import ProcessSandbox, new_handle
from ephemeral.settings import Settings

HOSTILE = Path(__file__).with_name("hostile_agent.py")


async def start_hostile(
    settings: Settings, mode: str, *, owner: str = "test", limits: Limits | None = None
) -> ProcessSandbox:
    """A ProcessSandbox (handle file, stderr drain, GuestClient) whose agent plays ``mode``."""
    handle = new_handle("fake", owner)
    sbx = ProcessSandbox(
        sandbox_id=handle.id,
        isolation="fake",
        image="hostile",
        handle=handle,
        handle_file=handles.write(settings.sandboxes_dir, handle),
        cgroups=None,
        limits=limits or Limits(),
        runtime="hostile_agent.py",
    )
    await sbx._start([sys.executable, str(HOSTILE), mode])
    return sbx
