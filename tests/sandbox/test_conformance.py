"""What every sandbox driver must do, run against each driver this host can really start, on
the ``default`` image and on one of Debian's static busybox alone (no libc, no Python: our side
runs on the agent runtime); a check needing a tool the image lacks skips there, naming it.

The seed's own checks first (whoami, pwd, no network, /tmp/proof.txt, a second sandbox does
not see it), then exit codes, stdin, deadlines, output caps, limits, host invisibility and a
destroy that leaves nothing.
"""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.sandbox import cgroups
from ephemeral.sandbox.base import Limits, Sandbox, SandboxDriver
from ephemeral.settings import Settings
from tests.patience import PATIENCE
from tests.sandbox.conftest import DRIVERS, Factory, driver_for

pytestmark = pytest.mark.sandbox

REPO = Path(__file__).resolve().parents[2]
IMAGES = ["default", "busybox"]


@pytest.fixture(params=IMAGES)
def image(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name if name == "default" else request.getfixturevalue(f"{name}_image")


@pytest.fixture(params=DRIVERS)
def driver(
    request: pytest.FixtureRequest, sandbox_settings: Settings, rootfs: Path, image: str
) -> SandboxDriver:
    return driver_for(request.param, sandbox_settings, image)


async def needs(sbx: Sandbox, *tools: str) -> None:
    """Skip where the sandbox's image lacks one of ``tools``."""
    for tool in tools:
        if (await sbx.exec(["sh", "-c", f"command -v {tool}"])).exit_code != 0:
            pytest.skip(f"image {sbx.image} has no {tool}")


async def test_runs_as_worker_in_a_fresh_workdir(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    who = await sbx.exec("whoami")
    assert (who.exit_code, who.stdout) == (0, "worker\n")
    ids = await sbx.exec(["id", "-u"])
    assert ids.stdout.strip() == "1000"
    pwd = await sbx.exec("pwd")
    assert re.fullmatch(r"/tmp/ephemeral-run-[A-Za-z0-9_]+/scratch\n", pwd.stdout)
    assert pwd.stdout.strip() == sbx.workdir
    assert sbx.isolation in ("namespaces", "gvisor", "microvm-tcg", "microvm-kvm")


async def test_no_network_beyond_loopback(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    # (static glibc's resolver, busybox's, cannot load its NSS modules: only curl says why)
    if (await sbx.exec("command -v curl")).exit_code == 0:
        res = await sbx.exec("curl -sS -m 8 https://example.com", timeout=PATIENCE)
        assert res.exit_code != 0
        assert "Could not resolve host" in res.stderr
    ifaces = await sbx.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
    assert ifaces.stdout.split() == ["lo"]


async def test_files_do_not_leak_between_sandboxes(make_sandbox: Factory) -> None:
    first = await make_sandbox()
    wrote = await first.exec("echo proof > /tmp/proof.txt && ls -l /tmp/proof.txt")
    assert wrote.exit_code == 0, wrote.stderr
    assert "/tmp/proof.txt" in wrote.stdout
    second = await make_sandbox()
    seen = await second.exec("test -e /tmp/proof.txt")
    assert seen.exit_code == 1


async def test_exit_codes_and_stderr(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    res = await sbx.exec("echo out; echo oops >&2; exit 3")
    assert (res.exit_code, res.stdout, res.stderr) == (3, "out\n", "oops\n")
    assert (await sbx.exec(["sh", "-c", "exit 7"])).exit_code == 7
    missing = await sbx.exec(["no-such-command"])
    assert missing.exit_code == 127
    notfound = await sbx.exec("no-such-command")
    assert notfound.exit_code == 127 and "not found" in notfound.stderr
    assert not res.timed_out and not res.truncated
    await sbx.put_file("not-executable", b"echo hi\n", mode=0o644)
    assert (await sbx.exec(["./not-executable"])).exit_code == 126
    with pytest.raises(errors.InvalidRequest, match="cwd"):
        await sbx.exec("true", cwd="/nonexistent")
    # a command that exits without reading its stdin must not take the agent down
    early = await sbx.exec(["true"], stdin=b"x" * 1_000_000)
    assert early.exit_code == 0
    assert (await sbx.exec("echo alive")).stdout == "alive\n"


async def test_stdin_env_and_cwd(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    big = os.urandom(300_000)
    res = await sbx.exec("sha256sum", stdin=big)
    import hashlib

    assert res.stdout.split()[0] == hashlib.sha256(big).hexdigest()
    env = await sbx.exec("echo $GREETING", env={"GREETING": "hello"})
    assert env.stdout == "hello\n"
    await sbx.exec("mkdir sub")
    cwd = await sbx.exec("pwd", cwd="sub")
    assert cwd.stdout.strip() == f"{sbx.workdir}/sub"


async def test_put_and_get_files(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    blob = bytes(range(256)) * 100
    await sbx.put_file("data/blob.bin", blob)
    await sbx.put_file("run.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
    assert (await sbx.exec("./run.sh")).stdout == "ran\n"
    assert await sbx.get_file("data/blob.bin") == blob
    assert await sbx.get_file(f"{sbx.workdir}/data/blob.bin") == blob
    with pytest.raises(errors.NotFound):
        await sbx.get_file("nope.txt")
    with pytest.raises(errors.PayloadTooLarge):
        await sbx.get_file("data/blob.bin", max_bytes=100)
    # a refused request is an answer, not a broken sandbox
    assert (await sbx.exec("true")).exit_code == 0


async def test_deadline_kills_the_command_and_its_children(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    res = await sbx.exec("sleep 1000 & setsid sleep 1000 & (sleep 1000 &); sleep 1000", timeout=1.0)
    assert res.timed_out
    assert res.exit_code == 137
    left = await sbx.exec("ps -eo comm= | grep -c '^sleep$'")
    assert left.stdout.strip() == "0", left.stdout
    assert (await sbx.exec("echo still here")).stdout == "still here\n"


async def test_output_flood_is_capped_and_flagged(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    res = await sbx.exec("head -c 5000000 /dev/zero | tr '\\0' a", max_output=65536)
    assert res.exit_code == 0
    assert res.truncated
    assert len(res.stdout) == 65536
    endless = await sbx.exec("yes", timeout=3.0, max_output=1000)
    assert endless.truncated and endless.timed_out and len(endless.stdout) == 1000


async def test_fork_bomb_stays_inside_the_pids_limit(make_sandbox: Factory) -> None:
    sbx = await make_sandbox(pids=64)
    cg = cgroups.CgroupSet.for_id(sbx.id)
    try:
        res = await sbx.exec(
            "for i in $(seq 1 400); do sleep 30 </dev/null >/dev/null 2>&1 & done; wait",
            timeout=5.0,
        )
        # namespaces: fork fails inside; the deadline then kills what did start
        assert res.exit_code != 0
        after = await sbx.exec("echo alive")
        assert after.stdout == "alive\n"
    except errors.SandboxError:
        # gvisor: the host pids limit stops the Sentry; the sandbox dies, the host does not
        assert sbx.isolation == "gvisor"
    for d in cg.dirs:
        if d.parent.parent.name == "pids" and (d / "pids.max").exists():
            peak_file = d / "pids.peak"
            if peak_file.exists():
                assert int(peak_file.read_text()) <= int((d / "pids.max").read_text())


async def test_memory_bomb_stays_inside_the_memory_limit(make_sandbox: Factory) -> None:
    sbx = await make_sandbox(memory_mib=128)
    await needs(sbx, "python3")
    res = await sbx.exec("python3 -c 'b = bytearray(600 << 20); print(len(b))'", timeout=30)
    assert res.exit_code != 0
    assert "629145600" not in res.stdout
    assert (await sbx.exec("echo alive")).stdout == "alive\n"


async def test_disk_fill_stops_at_the_disk_limit(make_sandbox: Factory) -> None:
    sbx = await make_sandbox(disk_mib=32)
    res = await sbx.exec("dd if=/dev/zero of=big bs=1M count=100", timeout=30)
    assert res.exit_code != 0
    assert "No space left" in res.stderr
    size = await sbx.exec("stat -c %s big")
    assert int(size.stdout) <= 32 << 20
    await sbx.exec("rm big")
    assert (await sbx.exec("echo alive > ok && cat ok")).stdout == "alive\n"


async def test_host_environment_and_files_are_invisible(
    make_sandbox: Factory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    canary = base64.b32encode(os.urandom(10)).decode()
    monkeypatch.setenv("EPHEMERAL_TEST_CANARY", canary)
    # the file's name must differ from its content: error messages echo the name
    canary_file = REPO / f".canary-{os.getpid()}"
    canary_file.write_text(canary)
    try:
        sbx = await make_sandbox()
        env = await sbx.exec("env; cat /proc/1/environ | tr '\\0' '\\n'")
        assert canary not in env.stdout
        assert "EPHEMERAL_TEST_CANARY" not in env.stdout
        look = await sbx.exec(
            f"ls -a {REPO} /root 2>&1; cat {canary_file} 2>&1; "
            f"grep -rl {canary} /tmp /home /root /run 2>/dev/null; true"
        )
        assert canary not in look.stdout
        host_only = await sbx.exec(f"test -e {REPO}/pyproject.toml")
        assert host_only.exit_code != 0
    finally:
        canary_file.unlink()


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed process's zombie waits for the host's init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def _host_state(sandbox_id: str) -> dict[str, object]:
    mounts = Path("/proc/self/mountinfo").read_text()
    cg = sorted(str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{cgroups.PARENT}/{sandbox_id}"))
    cg += sorted(str(p) for p in Path("/sys/fs/cgroup").glob(f"{cgroups.PARENT}/{sandbox_id}"))
    return {"mounts": sandbox_id in mounts, "cgroups": cg}


async def test_destroy_leaves_nothing(make_sandbox: Factory, sandbox_settings: object) -> None:
    sbx: Sandbox = await make_sandbox()
    assert (await sbx.exec("sleep 300 </dev/null >/dev/null 2>&1 &")).exit_code == 0
    pids: set[int] = set(getattr(sbx, "host_pids", set()))
    assert pids, "a real sandbox has host processes"
    handle = Path(sandbox_settings.sandboxes_dir) / f"{sbx.id}.json"  # type: ignore[attr-defined]
    assert handle.exists()
    await sbx.destroy()
    await sbx.destroy()  # idempotent
    alive = [p for p in pids if _running(p)]
    assert alive == []
    state = _host_state(sbx.id)
    assert state == {"mounts": False, "cgroups": []}
    assert not handle.exists()
    run_dir = Path(sandbox_settings.state_dir) / "run" / sbx.id  # type: ignore[attr-defined]
    assert not run_dir.exists()
    with pytest.raises(errors.SandboxError):
        await sbx.exec("true")


async def test_lifetime_ends_the_sandbox(make_sandbox: Factory) -> None:
    import asyncio

    sbx = await make_sandbox(lifetime_seconds=2.0)
    pids: set[int] = set(getattr(sbx, "host_pids", set()))
    async with asyncio.timeout(30):  # 2 s, and the teardown, however loaded the host
        while sbx.alive:
            await asyncio.sleep(0.1)
    with pytest.raises(errors.SandboxError):
        await sbx.exec("true")
    async with asyncio.timeout(30):
        while [p for p in pids if _running(p)]:
            await asyncio.sleep(0.1)


async def test_async_with_destroys_and_adopt_reowns(
    driver: SandboxDriver, sandbox_settings: Settings
) -> None:
    handles_dir = Path(sandbox_settings.sandboxes_dir)
    with pytest.raises(RuntimeError, match="inside"):
        async with await driver.create(owner="pool", limits=Limits()) as sbx:
            assert sbx.alive
            await sbx.adopt("run_" + "c" * 32)
            handle = json.loads((handles_dir / f"{sbx.id}.json").read_text())
            assert handle["owner"] == "run_" + "c" * 32
            assert (await sbx.exec("true")).exit_code == 0  # adoption keeps it usable
            pids: set[int] = set(getattr(sbx, "host_pids", set()))
            raise RuntimeError("failed inside")
    assert not sbx.alive
    assert pids and [p for p in pids if _running(p)] == []
    assert not (handles_dir / f"{sbx.id}.json").exists()
