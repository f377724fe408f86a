"""A trial's sandbox gets the task's cpus, memory and disk: ``Sessions.create(limits=...)``, what
the Harbor environment passes (docs/integrations.md), reaches the sandbox's host cgroup."""

from __future__ import annotations

from pathlib import Path

from ephemeral.engine.runtime import Runtime
from ephemeral.sandbox import cgroups
from ephemeral.sandbox.base import Limits
from ephemeral.sessions.requests import ExecRequest, SessionRequest
from tests.sessions.conftest import org, runtime, session_settings

__all__ = ["org", "runtime", "session_settings"]


async def test_a_session_runs_under_the_limits_it_was_given(
    runtime: Runtime, org: str, isolation: str
) -> None:
    asked = Limits(cpus=0.5, memory_mib=300, pids=200, disk_mib=64)
    row, _ = await runtime.sessions.create(
        org,
        SessionRequest(isolation=isolation, timeout_seconds=60),  # type: ignore[arg-type]
        limits=asked,
    )
    try:
        assert row.status == "running" and row.sandbox_id
        dirs = cgroups.CgroupSet.for_id(row.sandbox_id).dirs
        if cgroups.is_v2():
            (d,) = dirs
            quota, period = (d / "cpu.max").read_text().split()
            memory = int((d / "memory.max").read_text())
            pids = int((d / "pids.max").read_text())
        else:
            mem_d, pids_d, cpu_d = dirs
            quota = (cpu_d / "cpu.cfs_quota_us").read_text().strip()
            period = (cpu_d / "cpu.cfs_period_us").read_text().strip()
            memory = int((mem_d / "memory.limit_in_bytes").read_text())
            pids = int((pids_d / "pids.max").read_text())
        assert int(quota) / int(period) == 0.5
        # gVisor's Sentry and Gofer share the cgroup: the driver adds their headroom on top
        assert 300 << 20 <= memory < 1024 << 20
        assert pids >= 200
        res = await runtime.sessions.exec(
            row.id, org, ExecRequest(command="df -m /tmp | tail -1", user="root")
        )
        assert res.exit_code == 0 and int(res.stdout.split()[1]) <= 64, res.stdout
    finally:
        await runtime.sessions.end(row.id, org)
    assert not any(Path(d).exists() for d in dirs)
