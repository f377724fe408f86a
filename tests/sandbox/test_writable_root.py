"""The writable root (issue 23): every sandbox's ``/`` is a private copy-on-write overlay of the
shared image, bounded by the disk limit and gone with the sandbox; the image is never written.
Above ``disk_tmpfs_max_mib`` its upper layer is an ext4 file on the host's disk instead of a
tmpfs (issue 36, item 7): larger than memory, ``ENOSPC`` at the limit, gone with the sandbox.

Real sandboxes on every level this host starts (``namespaces``, ``gvisor``; ``microvm-tcg`` in
the ``tcg_slow`` set, where the overlay is the guest's own tmpfs).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from ephemeral.sandbox import handles, reaper, registry, writable_root
from ephemeral.sandbox.base import Limits, SandboxDriver
from ephemeral.sandbox.process import new_handle
from ephemeral.settings import Settings
from tests.sandbox.conftest import Factory
from tests.sandbox.leaks import loop_devices

pytestmark = pytest.mark.sandbox

# A tiny Debian package, built and installed as root at run time: what `apt-get install` does
# once it has the .deb (there is no network here to fetch one).
DPKG_INSTALL = textwrap.dedent("""\
    set -e
    d=$(mktemp -d)
    mkdir -p "$d/pkg/DEBIAN" "$d/pkg/usr/bin"
    c="$d/pkg/DEBIAN/control"
    printf 'Package: ephemeral-hello\\nVersion: 1.0\\nArchitecture: all\\n' > "$c"
    printf 'Maintainer: tests <t@example.invalid>\\nDescription: test\\n' >> "$c"
    printf '#!/bin/sh\\necho hello from a package\\n' > "$d/pkg/usr/bin/ephemeral-hello"
    chmod 755 "$d/pkg/usr/bin/ephemeral-hello"
    dpkg-deb --root-owner-group --build "$d/pkg" "$d/hello.deb" >/dev/null
    dpkg -i "$d/hello.deb" >/dev/null
""")


def _wheel() -> bytes:
    """A minimal pure-Python wheel (``ephemeral_probe``), made here: pip installs it offline."""
    files = {
        "ephemeral_probe/__init__.py": b"VALUE = 42\n",
        "ephemeral_probe-1.0.dist-info/METADATA": (
            b"Metadata-Version: 2.1\nName: ephemeral-probe\nVersion: 1.0\n"
        ),
        "ephemeral_probe-1.0.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("ephemeral_probe-1.0.dist-info/RECORD,,")
    files["ephemeral_probe-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return out.getvalue()


def _mount_namespaces_holding(tag: str) -> list[int]:
    """Host pids whose mount namespace still has a mount named ``tag``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if tag in (entry / "mountinfo").read_text():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


async def test_root_writes_stay_in_their_own_sandbox(make_sandbox: Factory, rootfs: Path) -> None:
    first = await make_sandbox()
    mark = f"mark-{first.id}"
    res = await first.exec(
        f"echo {mark} > /etc/ephemeral-mark && mkdir -p /usr/local/share/eph && "
        f"echo {mark} > /usr/local/share/eph/a && rm /etc/debian_version && "
        "cat /etc/ephemeral-mark /usr/local/share/eph/a && ls /etc/debian_version",
        user="root",
    )
    assert res.stdout.split() == [mark, mark], res
    assert res.exit_code != 0 and "No such file" in res.stderr  # the deletion shows too
    # the image's permissions still apply: the worker cannot write /usr or /etc
    res = await first.exec("touch /usr/worker-file /etc/worker-file")
    assert res.exit_code != 0 and res.stderr.count("Permission denied") == 2, res

    second = await make_sandbox()
    res = await second.exec(
        "cat /etc/debian_version; ls /etc/ephemeral-mark /usr/local/share/eph 2>&1; true"
    )
    assert res.stdout.count("No such file") == 2, res
    assert res.stdout.split()[0] == (rootfs / "etc/debian_version").read_text().strip()
    # the shared image on the host was never written
    assert not (rootfs / "etc/ephemeral-mark").exists()
    assert not (rootfs / "usr/local/share/eph").exists()
    assert (rootfs / "etc/debian_version").is_file()


async def test_a_write_past_the_disk_limit_fails_inside(make_sandbox: Factory) -> None:
    sbx = await make_sandbox(disk_mib=16)
    res = await sbx.exec("dd if=/dev/zero of=/usr/fill bs=1M count=64", user="root", timeout=60)
    assert res.exit_code != 0 and "No space left on device" in res.stderr, res
    size = await sbx.exec("stat -c %s /usr/fill")
    assert int(size.stdout) <= 16 << 20
    # the sandbox carries on, and freeing the space makes it writable again
    res = await sbx.exec("rm /usr/fill && echo again > /usr/small && cat /usr/small", user="root")
    assert (res.exit_code, res.stdout) == (0, "again\n"), res


async def test_a_disk_backed_root_holds_more_than_memory(
    driver: SandboxDriver, make_sandbox: Factory, sandbox_settings: Settings
) -> None:
    """1024 MiB of root for a sandbox of 512 MiB of memory (a tmpfs of it would be an OOM
    kill): filled to ENOSPC, /tmp too (it is on the disk), and the sandbox carries on; at
    destroy its loop device and file are gone (the factory checks every sandbox for loop
    devices naming it, too). tests/sessions/test_disk.py writes 700 MiB and reads it back."""
    _microvm_skip(driver)
    sbx = await make_sandbox(memory_mib=512, disk_mib=1024)
    assert loop_devices(sbx.id), "a disk-backed root is on a loop device while it lives"
    df = await sbx.exec("df -k --output=size / /tmp | tail -n +2", user="root")
    root_k, tmp_k = (int(k) for k in df.stdout.split())
    assert 900 << 10 < root_k <= 1024 << 10 and tmp_k == root_k, df  # /tmp is on the disk
    full = await sbx.exec("dd if=/dev/zero of=/tmp/fill bs=1M", timeout=600)
    assert full.exit_code != 0 and "No space left on device" in full.stderr, full
    size = await sbx.exec("stat -c %s /tmp/fill")
    assert 900 << 20 < int(size.stdout) <= 1024 << 20, size
    after = await sbx.exec("rm /tmp/fill && echo again > /again && cat /again", user="root")
    assert (after.exit_code, after.stdout) == (0, "again\n"), after
    run_dir = sandbox_settings.state_dir / "run" / sbx.id
    assert not (run_dir / writable_root.DISK_FILE).exists()  # unlinked once mounted
    await sbx.destroy()
    assert loop_devices(sbx.id) == [] and not run_dir.exists()


def test_a_disk_backed_root_counts_no_memory() -> None:
    """The tmpfs sizes left to /tmp and the upper layer are none with a disk-backed root: the
    memory limit holds only the small mounts."""
    limits = Limits(memory_mib=512, disk_mib=1024)
    assert writable_root.tmpfs_sizes(limits, 4, disk=True) == (0, 16 << 20)
    assert writable_root.tmpfs_sizes(limits, 4).large == 192 << 20
    settings = Settings.load(disk_tmpfs_max_mib=256)
    assert not writable_root.on_disk(Limits(disk_mib=256), settings)
    assert writable_root.on_disk(Limits(disk_mib=257), settings)


def _microvm_skip(driver: SandboxDriver) -> None:
    if driver.isolation.startswith("microvm"):
        pytest.skip("a microVM's overlay and /tmp live in the guest's RAM, sized by its stage 0")


async def test_filling_the_root_and_tmp_is_enospc_and_the_sandbox_carries_on(
    driver: SandboxDriver, make_sandbox: Factory
) -> None:
    """Issue 35, finding 9: the upper layer and /tmp were each the disk limit, so filling both
    (and the small mounts) passed the memory limit, whose OOM kill took the guest agent
    (``sandbox_error``). Now they fit inside the memory limit together: ``ENOSPC``."""
    _microvm_skip(driver)
    sbx = await make_sandbox(memory_mib=256, disk_mib=256)
    root = await sbx.exec("dd if=/dev/zero of=/fill bs=1M", user="root", timeout=120)
    assert "No space left on device" in root.stderr, root
    tmp = await sbx.exec("dd if=/dev/zero of=/tmp/fill bs=1M", timeout=120)
    assert "No space left on device" in tmp.stderr, tmp
    # (/dev: read-only in namespaces; gVisor's is its own, sized by nothing: docs/security.md)
    shm = "/dev/shm" if driver.isolation == "namespaces" else ""
    small = await sbx.exec(
        f"for d in /run /var/tmp {shm} ~; do dd if=/dev/zero of=$d/fill bs=1M; done",
        user="root",
        timeout=120,
    )
    assert "No space left on device" in small.stderr, small
    # the same sandbox answers the next command, and writes again once space is freed
    after = await sbx.exec("rm /fill && echo again > /again && cat /again", user="root")
    assert (after.exit_code, after.stdout) == (0, "again\n"), after
    # the root and /tmp hold at most what the limit leaves beside its 64 MiB of headroom and
    # the four 16 MiB mounts
    df = await sbx.exec("df -k --output=size,target | tail -n +2", user="root")
    held = {t: int(k) << 10 for k, t in (line.split() for line in df.stdout.splitlines())}
    assert held["/"] + held["/tmp"] <= (256 - 64 - 4 * 16) << 20, df.stdout


async def test_commands_are_the_oom_killers_choice_before_the_agent(
    driver: SandboxDriver, make_sandbox: Factory
) -> None:
    """Issue 35, finding 9: forty commands, each smaller than the guest agent, outgrow the
    memory limit together; the OOM killer took the agent (the largest process). Commands now
    run at oom_score_adj 1000, so they go first and the sandbox answers the next command."""
    _microvm_skip(driver)
    if driver.isolation == "gvisor":
        pytest.skip(
            "gVisor has no OOM killer of its own: past the limit the host's takes the Sentry"
        )
    sbx = await make_sandbox(memory_mib=128, pids=512)
    adj = await sbx.exec("cat /proc/self/oom_score_adj")
    assert adj.stdout == "1000\n", adj
    # (the swarm's own shell may be one of the OOM killer's choices: its status says nothing)
    await sbx.exec(
        "for i in $(seq 40); do "
        "sh -c 'x=$(head -c 3000000 /dev/zero | tr \"\\0\" a); sleep 5' & done; wait",
        timeout=120,
    )
    assert (await sbx.exec("echo alive")).stdout == "alive\n"


async def test_root_installs_a_package_and_adds_a_user(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    res = await sbx.exec(DPKG_INSTALL, user="root", timeout=120)
    assert res.exit_code == 0, res
    res = await sbx.exec("ephemeral-hello; dpkg -s ephemeral-hello | grep Status")
    assert res.stdout == "hello from a package\nStatus: install ok installed\n", res

    res = await sbx.exec(
        ["adduser", "--comment", "test", "--disabled-password", "tester"], user="root", timeout=60
    )
    assert res.exit_code == 0, res
    res = await sbx.exec("whoami; id -u; echo $HOME; touch ~/mine", user="tester")
    assert res.exit_code == 0, res
    name, uid, home = res.stdout.split()
    assert (name, home) == ("tester", "/home/tester") and int(uid) >= 1000 and uid != "1000"
    assert (await sbx.exec("whoami")).stdout == "worker\n"  # the default user is unchanged
    assert (await sbx.exec("whoami", user="root")).stdout == "root\n"


async def test_root_pip_installs_into_the_system_site(
    driver: SandboxDriver, sandbox_settings: Settings
) -> None:
    settings = sandbox_settings.model_copy(update={"image": "python-dev"})
    async with await registry.get_driver(driver.isolation, settings).create(
        owner="test", limits=Limits()
    ) as sbx:
        await sbx.put_file("/tmp/ephemeral_probe-1.0-py3-none-any.whl", _wheel())
        # Debian marks its Python externally managed (PEP 668): as in a debian:bookworm
        # container, a system-wide install says so
        res = await sbx.exec(
            "python3 -m pip install --break-system-packages "
            "/tmp/ephemeral_probe-1.0-py3-none-any.whl",
            user="root",
            timeout=120,
        )
        assert res.exit_code == 0, res
        res = await sbx.exec("python3 -c 'import ephemeral_probe as p; print(p.VALUE, p.__file__)'")
        value, path = res.stdout.split()
        assert value == "42" and path.startswith("/usr/local/lib/python3"), res


async def test_the_upper_layer_is_gone_at_destroy(
    driver: SandboxDriver, make_sandbox: Factory
) -> None:
    if driver.isolation.startswith("microvm"):
        pytest.skip("a microVM's upper layer is a tmpfs in guest RAM: it ends with QEMU")
    sbx = await make_sandbox()
    await sbx.exec("dd if=/dev/zero of=/usr/data bs=1M count=4", user="root")
    tag = writable_root.tag(sbx.id)
    assert _mount_namespaces_holding(tag)  # the test sees the upper layer while it lives
    await sbx.destroy()
    assert _mount_namespaces_holding(tag) == []


CRASHER = textwrap.dedent("""
    import asyncio, json, sys, time
    from ephemeral.settings import Settings
    from ephemeral.sandbox.registry import get_driver
    from ephemeral.sandbox.base import Limits
    async def main():
        s = Settings.load(state_dir=sys.argv[2])
        limits = Limits(disk_mib=int(sys.argv[3]))
        sbx = await get_driver(sys.argv[1], s).create(owner="run_" + "0" * 32, limits=limits)
        await sbx.exec("echo crashed > /etc/crash-mark", user="root")
        print(json.dumps({"id": sbx.id}), flush=True)
        time.sleep(600)
    asyncio.run(main())
""")


@pytest.mark.parametrize("disk_mib", [256, 1024], ids=["tmpfs", "disk"])
async def test_the_reaper_frees_the_upper_layer_of_a_crashed_host(
    driver: SandboxDriver, sandbox_settings: Settings, rootfs: Path, disk_mib: int
) -> None:
    if driver.isolation.startswith("microvm"):
        pytest.skip("a microVM's upper layer is a tmpfs in guest RAM: it ends with QEMU")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CRASHER,
        driver.isolation,
        str(sandbox_settings.state_dir),
        str(disk_mib),
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        sandbox_id = json.loads(line)["id"]
        held = loop_devices(sandbox_id)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the host process dies without any cleanup
        await proc.wait()
    assert bool(held) == (disk_mib > sandbox_settings.disk_tmpfs_max_mib), held
    assert sandbox_id in await reaper.reap(sandbox_settings)
    assert _mount_namespaces_holding(writable_root.tag(sandbox_id)) == []
    assert loop_devices(sandbox_id) == []  # its loop device and the file's blocks are freed
    assert not (sandbox_settings.state_dir / "run" / sandbox_id).exists()
    assert not (rootfs / "etc/crash-mark").exists()


async def test_the_reaper_removes_a_disk_file_a_crash_left_before_its_mount(
    sandbox_settings: Settings,
) -> None:
    """A host that died between making a sandbox's disk file and its launcher's mount (which
    unlinks it) leaves the file in the run directory its handle names: the reap removes it."""
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    handle = new_handle("namespaces", "test")
    handle.host_pid, handle.host_start_time = int(dead.stdout), 1  # gone (or another process)
    run_dir = sandbox_settings.state_dir / "run" / handle.id
    handle.paths = [str(run_dir)]
    handles.write(sandbox_settings.sandboxes_dir, handle)
    disk = writable_root.make_disk(run_dir, 64)
    assert disk.is_file() and disk.stat().st_size == 64 << 20
    assert (run_dir.stat().st_mode & 0o777, disk.stat().st_mode & 0o777) == (0o700, 0o600)
    assert handle.id in await reaper.reap(sandbox_settings)
    assert not run_dir.exists()


@pytest.mark.parametrize("disk_mib", [16, 300], ids=["tmpfs", "disk"])
async def test_without_the_compiled_helper_the_shell_makes_the_same_root(
    driver: SandboxDriver,
    make_sandbox: Factory,
    rootfs: Path,
    monkeypatch: pytest.MonkeyPatch,
    disk_mib: int,
) -> None:
    if driver.isolation.startswith("microvm"):
        pytest.skip("a microVM's overlay is made by its stage 0, not by the host")
    monkeypatch.setattr(writable_root, "helper", lambda cache_dir: None)  # as without gcc
    sbx = await make_sandbox(disk_mib=disk_mib)
    res = await sbx.exec(
        "echo fallback > /etc/fallback-mark && cat /etc/fallback-mark && stat -c %U /etc/passwd "
        "&& df -k / | tail -1",
        user="root",
    )
    assert res.exit_code == 0, res
    mark, owner, *df = res.stdout.split()
    assert (mark, owner) == ("fallback", "root")
    assert int(df[1]) <= disk_mib * 1024  # the disk limit's tmpfs, or its ext4 file
    assert bool(loop_devices(sbx.id)) == (disk_mib > 256)
    assert (await sbx.exec("touch /etc/worker-file")).exit_code != 0
    assert not (rootfs / "etc/fallback-mark").exists()


def test_the_helper_is_built_once_into_the_cache(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc here: sandboxes use the shell fallback (tested above)")
    built = writable_root.helper(tmp_path)
    assert built is not None and built.parent == tmp_path / "helpers"
    assert writable_root.helper(tmp_path) == built  # memoised
    usage = subprocess.run([str(built)], capture_output=True, text=True, check=False)
    assert usage.returncode == 2 and "usage: mount-root" in usage.stderr
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no temporary left
