"""The factory's leak check can fail: a live sandbox shows up in it, a destroyed one does not."""

from __future__ import annotations

import pytest

from ephemeral.sandbox.base import Limits, SandboxDriver
from ephemeral.settings import Settings
from tests.sandbox.leaks import footprint, leftovers

pytestmark = [pytest.mark.sandbox]


async def test_a_live_sandbox_is_seen_and_a_destroyed_one_is_gone(
    driver: SandboxDriver, sandbox_settings: Settings
) -> None:
    sbx = await driver.create(owner="test", limits=Limits())
    try:
        await sbx.exec("sleep 60 >/dev/null 2>&1 &")
        fp = footprint(sbx, sandbox_settings.sandboxes_dir)
        live = leftovers(fp)
        kinds = {what.split()[0] for what in live}
        assert "handle" in kinds and "process" in kinds, live
        if fp.handle is not None and fp.handle.cgroups:
            assert "cgroup" in kinds, live
    finally:
        await sbx.destroy()
    assert leftovers(fp) == []
