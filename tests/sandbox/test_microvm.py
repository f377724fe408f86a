"""microVM-specific behaviour, exercised under TCG (the only accelerator this host runs).

The conformance suite covers what every driver must do; these tests cover what only the
microVM path has: start from a saved memory snapshot, a fresh RNG per restore, no NIC device,
a read-only root disk under a RAM overlay, QEMU never outliving its sandbox, and an honest
KVM probe. The snapshot is built once (cached by hash under the image cache) per session.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.sandbox import handles
from ephemeral.sandbox.base import Limits
from ephemeral.sandbox.microvm import MicroVMDriver, MicroVMSandbox, Snapshot
from ephemeral.settings import Settings
from tests.drivers import unavailable
from tests.patience import PATIENCE

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

LIMITS = Limits()


@pytest.fixture(scope="module")
def tcg(tmp_path_factory: pytest.TempPathFactory) -> tuple[MicroVMDriver, Snapshot]:
    if shutil.which("qemu-system-x86_64") is None:
        unavailable("qemu-system-x86_64 is not installed", "microvm-tcg")
    settings = Settings.load(
        state_dir=tmp_path_factory.mktemp("microvm") / "state", use_prefect=False
    )
    driver = MicroVMDriver(settings, "tcg")
    try:
        snap = asyncio.run(driver.snapshot(LIMITS))
    except errors.EphemeralError as exc:
        why = f"microVM artifacts or snapshot could not be built: {exc.detail}"
        unavailable(why, "microvm-tcg")
    return driver, snap


async def _create(driver: MicroVMDriver, limits: Limits = LIMITS) -> MicroVMSandbox:
    sbx = await driver.create(owner="test-microvm", limits=limits)
    assert isinstance(sbx, MicroVMSandbox)
    return sbx


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _exists(path: str) -> bool:
    return os.path.exists(path)


async def _gone(pid: int, within: float = 20.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while loop.time() < end:
        if not _alive(pid):
            return True
        await asyncio.sleep(0.05)
    return False


def test_vm_definition_has_no_nic_and_a_read_only_root(tcg: tuple[MicroVMDriver, Snapshot]):
    _, snap = tcg
    argv = snap.argv
    assert not {"-netdev", "-nic", "-net"} & set(argv)
    assert "-nodefaults" in argv  # no default NIC either
    # the image's disk and the agent runtime's, both read-only
    drives = [argv[i + 1] for i, a in enumerate(argv) if a == "-drive"]
    assert [d.split(",", 1)[0] for d in drives] == ["id=root", "id=agent"]
    assert all("readonly=on" in d for d in drives)
    assert snap.meta.hello.workdir.startswith("/tmp/ephemeral-run-")


async def test_restore_runs_commands_as_worker(tcg: tuple[MicroVMDriver, Snapshot]):
    driver, snap = tcg
    sbx = await _create(driver)
    try:
        assert sbx.isolation == "microvm-tcg"
        assert sbx.workdir == snap.meta.hello.workdir
        res = await sbx.exec("whoami; pwd")
        assert res.exit_code == 0, res
        assert res.stdout.split() == ["worker", sbx.workdir]
        res = await sbx.exec(["sh", "-c", "echo oops >&2; exit 3"])
        assert (res.exit_code, res.stderr) == (3, "oops\n")
    finally:
        await sbx.destroy()


async def test_reseed_makes_restored_vms_differ(tcg: tuple[MicroVMDriver, Snapshot]):
    driver, _ = tcg
    a, b = await _create(driver), await _create(driver)
    try:
        cmd = (
            "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; "
            "cat /proc/sys/kernel/random/uuid"
        )
        ra, rb = await a.exec(cmd), await b.exec(cmd)
        assert ra.exit_code == rb.exit_code == 0
        assert len(ra.stdout.split()[0]) == 64
        # both restored the same RAM image, so only the reseed can make these differ
        assert ra.stdout.split()[0] != rb.stdout.split()[0]
        assert ra.stdout.split()[1] != rb.stdout.split()[1]
    finally:
        await a.destroy()
        await b.destroy()


async def test_no_network_interface_but_lo(tcg: tuple[MicroVMDriver, Snapshot]):
    driver, _ = tcg
    sbx = await _create(driver)
    try:
        res = await sbx.exec("ls /sys/class/net; curl -sS -m 8 https://example.com")
        assert res.stdout.split() == ["lo"]
        assert res.exit_code != 0
        assert "Could not resolve host" in res.stderr
    finally:
        await sbx.destroy()


async def test_root_disk_is_read_only_and_writes_stay_in_the_vm(
    tcg: tuple[MicroVMDriver, Snapshot],
):
    driver, _ = tcg
    first = await _create(driver)
    try:
        res = await first.exec("cat /sys/block/vda/ro; awk '$2==\"/\"{print $3}' /proc/mounts")
        assert res.stdout.split() == ["1", "overlay"]
        # root (the agent) may write anywhere: it lands in the tmpfs overlay, not on the disk
        await first.put_file("/etc/ephemeral-proof", b"x")
        res = await first.exec(
            "cat /etc/ephemeral-proof; echo hi > /tmp/proof.txt; "
            "touch /usr/worker-cannot 2>&1; true"
        )
        assert res.stdout.startswith("x")
        assert "Permission denied" in res.stdout
    finally:
        await first.destroy()
    second = await _create(driver)
    try:
        res = await second.exec("ls /tmp/proof.txt /etc/ephemeral-proof")
        assert res.exit_code != 0
        assert "No such file" in res.stderr
    finally:
        await second.destroy()


async def test_destroy_kills_qemu_and_leaves_nothing(tcg: tuple[MicroVMDriver, Snapshot]):
    driver, _ = tcg
    sbx = await _create(driver)
    pid = sbx.qemu_pid
    assert pid is not None and _alive(pid)
    handle_file = handles.handle_path(driver.settings.sandboxes_dir, sbx.id)
    handle = handles.read_all(driver.settings.sandboxes_dir)
    assert [(p, h.pgid if h else None) for p, h in handle] == [(handle_file, pid)]
    run_dirs = [Path(p) for _, h in handle if h for p in h.paths]
    assert run_dirs and all(d.is_dir() for d in run_dirs)
    await sbx.destroy()
    await sbx.destroy()  # idempotent
    assert not _alive(pid)
    assert not handle_file.exists()
    assert not any(d.exists() for d in run_dirs)
    with pytest.raises(errors.SandboxError):
        await sbx.exec("true")


async def test_reaper_can_kill_a_vm_from_its_handle(tcg: tuple[MicroVMDriver, Snapshot]):
    """A crashed host process leaves only the handle file; it names enough to kill QEMU."""
    driver, _ = tcg
    sbx = await _create(driver)
    pid = sbx.qemu_pid
    assert pid is not None
    try:
        [(path, handle)] = handles.read_all(driver.settings.sandboxes_dir)
        assert handle is not None and handle.driver == "microvm-tcg"
        await asyncio.to_thread(handles.teardown, handle, path)
        assert await _gone(pid)
        assert not path.exists()
    finally:
        await sbx.destroy()


async def test_lifetime_is_enforced_by_the_host(tcg: tuple[MicroVMDriver, Snapshot]):
    driver, _ = tcg
    sbx = await _create(driver, LIMITS.model_copy(update={"lifetime_seconds": 2.0}))
    pid = sbx.qemu_pid
    assert pid is not None
    try:
        assert await _gone(pid, within=30)
        with pytest.raises(errors.SandboxError):
            await sbx.exec("true")
    finally:
        await sbx.destroy()


async def test_a_failed_restore_leaves_no_qemu(tcg: tuple[MicroVMDriver, Snapshot], tmp_path: Path):
    driver, snap = tcg
    bad = tmp_path / "state.bin"
    bad.write_bytes(b"not a migration stream")
    broken = Snapshot(state=bad, argv=snap.argv, meta=snap.meta)
    before = _qemu_pids()
    with pytest.raises(errors.SandboxError):
        await driver._restore(broken, owner="test-microvm", limits=LIMITS)
    assert _qemu_pids() <= before
    assert handles.read_all(driver.settings.sandboxes_dir) == []


def _qemu_pids() -> set[int]:
    """QEMU processes started by this test process (other sessions may run their own)."""
    out = set()
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            comm = stat[stat.find("(") + 1 : stat.rfind(")")]
            ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
            if comm == "qemu-system-x86" and ppid == me:
                out.add(int(d.name))
    return out


async def test_kvm_probe_is_honest(tmp_path: Path):
    """``microvm-kvm`` is offered only if a guest kernel really boots under /dev/kvm."""
    if shutil.which("qemu-system-x86_64") is None:
        unavailable("qemu-system-x86_64 is not installed", "microvm-kvm")
    if not _exists("/dev/kvm"):
        unavailable("no /dev/kvm on this host", "microvm-kvm")
    driver = MicroVMDriver(Settings.load(state_dir=tmp_path / "state", use_prefect=False), "kvm")
    before = _qemu_pids()
    why = await driver.boot_probe(fresh=True)
    assert _qemu_pids() <= before  # the probe VM is gone either way (and was reaped)
    if why is None:
        return  # hardware KVM: the conformance suite runs microvm-kvm for real
    assert "did not reach init" in why or "exited" in why
    # the verdict is kept, so the next probe does not burn a core for the whole deadline
    assert await driver.boot_probe() == why


async def test_warm_pool_hands_out_a_restored_vm_once(tcg: tuple[MicroVMDriver, Snapshot]):
    from ephemeral.sandbox.pool import WarmPool

    driver, _ = tcg
    pool = WarmPool(driver, 1, LIMITS)
    await pool.start()
    try:
        await pool.wait_ready(timeout=PATIENCE)
        sbx = await pool.acquire("run_pooltest")
        assert isinstance(sbx, MicroVMSandbox) and sbx.alive
        try:
            [handle] = [
                h
                for _, h in handles.read_all(driver.settings.sandboxes_dir)
                if h is not None and h.id == sbx.id
            ]
            assert handle.owner == "run_pooltest"
            assert (await sbx.exec("whoami")).stdout == "worker\n"
        finally:
            await sbx.destroy()
        assert not sbx.alive
    finally:
        await pool.close()


_ORPHAN_SCRIPT = """
import asyncio, sys
from ephemeral.settings import Settings
from ephemeral.sandbox.base import Limits
from ephemeral.sandbox.microvm import MicroVMDriver

async def main():
    settings = Settings.load(state_dir=sys.argv[1], use_prefect=False)
    sbx = await MicroVMDriver(settings, "tcg").create(owner="orphan", limits=Limits())
    print(sbx.qemu_pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


async def test_vm_ends_itself_when_its_host_process_dies(
    tcg: tuple[MicroVMDriver, Snapshot], tmp_path: Path
):
    """SIGKILL of the host process closes the agent socket; the agent sees EOF and the guest
    reboots, which -no-reboot turns into QEMU exiting. No reaper needed for that case."""
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _ORPHAN_SCRIPT,
        str(tmp_path / "state"),
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        qemu_pid = int(line)
        assert _alive(qemu_pid)
    finally:
        proc.kill()
        await proc.wait()
    assert await _gone(qemu_pid, within=30)
    # the handle stays behind for the reaper, which now finds nothing alive to kill
    [(path, handle)] = handles.read_all(tmp_path / "state" / "sandboxes")
    assert handle is not None and handle.pgid == qemu_pid
    await asyncio.to_thread(handles.teardown, handle, path)


def test_image_build_hook_never_fails_the_image(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """images.ensure_image calls this after every build; the other drivers must not suffer
    from a host that cannot make microVM artifacts."""
    from ephemeral.sandbox import microvm_image

    settings = Settings.load(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache")
    with caplog.at_level("WARNING", logger="ephemeral.sandbox.microvm_image"):
        microvm_image.build_with_image(settings, "default", tmp_path / "no-rootfs", "0" * 16)
    assert "microVM artifacts for image default not built" in caplog.text
    assert not (settings.image_cache_dir / "microvm" / "rootfs").exists()


async def test_disk_and_pids_limits_apply_to_the_same_snapshot(tcg: tuple[MicroVMDriver, Snapshot]):
    """Only memory and vCPUs are baked into a snapshot; stage 2 applies the rest per restore."""
    driver, snap = tcg
    small = LIMITS.model_copy(update={"disk_mib": 32, "pids": 64})
    assert (await driver.snapshot(small)).state == snap.state  # no extra cold boot
    sbx = await _create(driver, small)
    try:
        res = await sbx.exec("awk '/Max processes/{print $3}' /proc/self/limits; df -m / | tail -1")
        assert res.exit_code == 0, res
        words = res.stdout.split()
        assert words[0] == "64"
        assert words[1:3] == ["overlay", "32"]
    finally:
        await sbx.destroy()
