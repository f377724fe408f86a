"""Reaper, warm pool and the namespaces driver's seccomp filter, on real sandboxes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from ephemeral.sandbox import agent_runtime, cgroups, reaper, registry
from ephemeral.sandbox.base import Limits, SandboxDriver
from ephemeral.sandbox.pool import WarmPool
from ephemeral.settings import Settings
from tests.drivers import unavailable
from tests.patience import PATIENCE

pytestmark = pytest.mark.sandbox

CRASHER = textwrap.dedent("""
    import asyncio, json, sys, time
    from ephemeral.settings import Settings
    from ephemeral.sandbox.registry import get_driver
    from ephemeral.sandbox.base import Limits
    async def main():
        s = Settings.load(state_dir=sys.argv[2])
        sbx = await get_driver(sys.argv[1], s).create(owner="run_" + "0" * 32, limits=Limits())
        await sbx.exec("sleep 600 </dev/null >/dev/null 2>&1 &")
        print(json.dumps({"id": sbx.id, "pids": sorted(sbx.host_pids)}), flush=True)
        time.sleep(600)
    asyncio.run(main())
""")


async def test_reaper_destroys_sandboxes_of_a_crashed_host(
    driver: SandboxDriver, sandbox_settings: Settings
) -> None:
    if driver.isolation.startswith("microvm"):
        pytest.skip("the microVM driver has its own reaper test")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CRASHER,
        driver.isolation,
        str(sandbox_settings.state_dir),
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    info = json.loads(line)
    os.kill(proc.pid, signal.SIGKILL)  # the host process dies without any cleanup
    await proc.wait()
    handle = sandbox_settings.sandboxes_dir / f"{info['id']}.json"
    assert handle.exists()
    destroyed = await reaper.reap(sandbox_settings)
    assert info["id"] in destroyed
    assert not handle.exists()
    for d in cgroups.CgroupSet.for_id(info["id"], all_controllers=True).dirs:
        assert not d.exists()
    for pid in info["pids"]:
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split(") ")[1][0] in "ZX"
    assert info["id"] not in await reaper.reap(sandbox_settings)


async def test_reaper_asks_about_run_owners(
    driver: SandboxDriver, sandbox_settings: Settings
) -> None:
    sbx = await driver.create(owner="run_" + "1" * 32, limits=Limits())
    try:
        asked: list[str] = []

        async def alive(owner: str) -> bool:
            asked.append(owner)
            return owner != "run_" + "1" * 32

        async def everyone_alive(owner: str) -> bool:
            return True

        assert sbx.id not in await reaper.reap(sandbox_settings, is_owner_alive=everyone_alive)
        assert sbx.id in await reaper.reap(sandbox_settings, is_owner_alive=alive)
        assert "run_" + "1" * 32 in asked
    finally:
        await sbx.destroy()


async def test_warm_pool_hands_out_each_sandbox_once(driver: SandboxDriver) -> None:
    pool = WarmPool(driver, size=2, limits=Limits())
    await pool.start()
    try:
        await pool.wait_ready(timeout=PATIENCE)
        a = await pool.acquire("run_" + "a" * 32)
        b = await pool.acquire("run_" + "b" * 32)
        c = await pool.acquire("run_" + "c" * 32)  # pool drained: a cold one
        assert len({a.id, b.id, c.id}) == 3
        for sbx in (a, b, c):
            assert (await sbx.exec("whoami")).stdout == "worker\n"
            await sbx.destroy()
        await pool.wait_ready(timeout=PATIENCE)  # refilled
        assert pool.ready_count == 2
    finally:
        await pool.close()
    assert pool.ready_count == 0


async def test_namespaces_seccomp_and_userns_lockdown(sandbox_settings: Settings) -> None:
    why = await registry.probe_level("namespaces", sandbox_settings)
    if why is not None:
        unavailable(f"namespaces cannot run here: {why}", "namespaces")
    driver = registry.get_driver("namespaces", sandbox_settings)
    sbx = await driver.create(owner="test", limits=Limits())
    try:
        # every host process of the sandbox (agent included) has an unprivileged host uid
        host_uids = {Path(f"/proc/{pid}").stat().st_uid for pid in sbx.host_pids}  # type: ignore[attr-defined]
        assert host_uids and 0 not in host_uids, host_uids
        probe = textwrap.dedent("""
            import ctypes, os
            libc = ctypes.CDLL(None, use_errno=True)
            for name, call in [("unshare", lambda: libc.unshare(0x10000000)),
                               ("ptrace", lambda: libc.ptrace(0, 0, 0, 0)),
                               ("keyctl", lambda: libc.syscall(250, 0, 0, 0, 0)),
                               ("bpf", lambda: libc.syscall(321, 0, 0, 0))]:
                rc = call()
                print(name, rc, os.strerror(ctypes.get_errno()))
        """)
        res = await sbx.exec(["python3", "-c", probe])
        lines = dict(line.split(" ", 1) for line in res.stdout.splitlines())
        for name in ("unshare", "ptrace", "keyctl", "bpf"):
            assert lines[name] == "-1 Operation not permitted", res.stdout
        caps = await sbx.exec("grep CapEff /proc/self/status")
        assert caps.stdout.split()[1] == "0000000000000000"
        ro = await sbx.exec("touch /etc/x")
        assert ro.exit_code != 0
    finally:
        await sbx.destroy()


async def test_the_agent_falls_back_to_ctypes_on_an_images_python(driver: SandboxDriver) -> None:
    """Where the runtime's ``_ephemeral_agent`` is absent (a microVM runs the agent on the
    image's python) the agent starts on ctypes and resource: a second agent on the ``default``
    image's own python, as root (its prctl(PR_SET_DUMPABLE) through ctypes) and as the worker,
    says hello and ends at its stdin's EOF."""
    if driver.isolation not in ("namespaces", "gvisor"):
        pytest.skip("the agent runtime is mounted under namespaces and gvisor only")
    sbx = await driver.create(owner="test", limits=Limits())
    try:
        agent = f"{agent_runtime.MOUNT}/agent.py"
        command = f"/usr/bin/python3 -I -S -X importtime {agent} --max-memory-mib 64 </dev/null"
        for user in ("root", None):
            res = await sbx.exec(command, user=user)
            assert res.exit_code == 0 and '"type":"hello"' in res.stdout, (user, res.stderr)
            imported = {
                line.rsplit("|", 1)[-1].strip()
                for line in res.stderr.splitlines()
                if line.startswith("import time:")
            }
            assert {"ctypes", "resource"} <= imported, res.stderr
    finally:
        await sbx.destroy()
