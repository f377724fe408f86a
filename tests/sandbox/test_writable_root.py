"""The writable root (issue 23): every sandbox's ``/`` is a private copy-on-write overlay of the
shared image, bounded by the disk limit and gone with the sandbox; the image is never written.

Real sandboxes on every level this host starts (``namespaces``, ``gvisor``; ``microvm-tcg`` in
the ``tcg_slow`` set, where the overlay is the guest's own tmpfs).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from ephemeral.sandbox import reaper, writable_root
from ephemeral.sandbox.base import SandboxDriver
from ephemeral.settings import Settings
from tests.sandbox.conftest import Factory

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
        sbx = await get_driver(sys.argv[1], s).create(owner="run_" + "0" * 32, limits=Limits())
        await sbx.exec("echo crashed > /etc/crash-mark", user="root")
        print(json.dumps({"id": sbx.id}), flush=True)
        time.sleep(600)
    asyncio.run(main())
""")


async def test_the_reaper_frees_the_upper_layer_of_a_crashed_host(
    driver: SandboxDriver, sandbox_settings: Settings, rootfs: Path
) -> None:
    if driver.isolation.startswith("microvm"):
        pytest.skip("a microVM's upper layer is a tmpfs in guest RAM: it ends with QEMU")
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
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the host process dies without any cleanup
        await proc.wait()
    sandbox_id = json.loads(line)["id"]
    assert sandbox_id in await reaper.reap(sandbox_settings)
    assert _mount_namespaces_holding(writable_root.tag(sandbox_id)) == []
    assert not (rootfs / "etc/crash-mark").exists()
