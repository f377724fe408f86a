"""A microVM boots a pulled image of any distribution: its layers made into one disk once per
image digest (the layers as directories, stacked by the guest's overlayfs), our agent on the
agent runtime's own disk, nothing of the image running our side.

Two images from the loopback registry: a Debian without Python (the ``default`` rootfs in two
layers, a third deleting Python, ``/etc/issue`` and ``/var/cache``'s contents by whiteouts and
an opaque directory, with ``Env``, ``WorkingDir`` and ``User`` in its config) and a lone
static busybox (no libc, no ``/tmp``, no ``/proc``). Each costs one cold TCG boot the first
time (its snapshot is kept in the shared microVM cache, keyed by the image's digest), then a
restore per sandbox."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

from ephemeral.oci.credentials import Credential, CredentialStore
from ephemeral.oci.reference import parse
from ephemeral.oci.store import LayerStore
from ephemeral.sandbox import microvm_image
from ephemeral.sandbox import registry as drivers_registry
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.settings import Settings
from tests.drivers import built_image, unavailable
from tests.oci import layouts as L
from tests.oci.conftest import PASSWORD, USER, MemberApi, Registry
from tests.sandbox.conftest import busybox_tree
from tests.sandbox.image_cache import link_runtime_source

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

ISOLATION = "microvm-tcg"
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "OCI_TEST": "from-config"}


@pytest.fixture(scope="module")
def vm_settings(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """A layer store of this module's own; the microVM cache (kernel, disks, snapshots) is the
    shared one, so a second session restores the snapshots the first one made."""
    why = asyncio.run(drivers_registry.probe_level(ISOLATION, Settings.load()))
    if why is not None:
        unavailable(f"{ISOLATION} cannot run here: {why}", ISOLATION)
    tmp = tmp_path_factory.mktemp("microvm-oci")
    settings = Settings.load(
        state_dir=tmp / "state",
        cache_dir=tmp / "cache",
        registry_ca_file=registry.ca_file,
        registry_private_hosts=[registry.host],
        use_prefect=False,
    )
    CredentialStore(settings).set(registry.host, Credential(username=USER, password=PASSWORD))
    link_runtime_source(settings)
    shared = microvm_image.microvm_cache(Settings.load())
    shared.mkdir(parents=True, exist_ok=True)
    settings.image_cache_dir.mkdir(parents=True, exist_ok=True)
    microvm_image.microvm_cache(settings).symlink_to(shared)
    return settings


@pytest.fixture(scope="module")
def no_python_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    root = built_image(Settings.load(), "default").rootfs
    top = sorted(p.name for p in root.iterdir() if p.name != "usr")
    version = next(root.glob("usr/lib/python3.*")).name  # python3.11
    gone = L.tar(
        [
            L.directory("usr"),
            L.directory("usr/bin"),
            L.directory("usr/lib"),
            L.file("usr/bin/.wh.python3"),
            L.file(f"usr/bin/.wh.{version}"),
            L.file(f"usr/lib/.wh.{version}"),
            L.directory("opt"),
            L.file("opt/.wh.ephemeral"),  # the default image's own copy of the agent
            L.file("etc/.wh.issue"),
            L.directory("var/cache"),
            L.file("var/cache/.wh..wh..opq"),
            L.file("var/cache/oci-only", "1"),
            L.file("etc/oci-marker", "third layer\n"),
            L.directory("srv/app"),
        ]
    )
    tmp = tmp_path_factory.mktemp("no-python-image")
    registry.push_image(
        tmp,
        "test/nopython:1",
        [L.tar_of_tree(root, ["usr"]), L.tar_of_tree(root, top), gone],
        compression=["gzip", "zstd", "gzip"],
        config={
            "Env": [f"{k}={v}" for k, v in ENV.items()],
            "WorkingDir": "/srv/app",
            "User": "worker",
        },
    )
    shutil.rmtree(tmp)
    return f"{registry.host}/test/nopython:1"


@pytest.fixture(scope="module")
def busybox_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    tree = Path(tempfile.mkdtemp(prefix="ephemeral-busybox-")) / "rootfs"
    busybox_tree(tree)
    tmp = tmp_path_factory.mktemp("busybox-image")
    registry.push_image(tmp, "test/busybox:1", [L.tar_of_tree(tree, ["bin", "etc"])])
    shutil.rmtree(tree.parent)
    shutil.rmtree(tmp)
    return f"{registry.host}/test/busybox:1"


def _driver(settings: Settings, image: str) -> drivers_registry.SandboxDriver:
    return drivers_registry.get_driver(ISOLATION, settings.model_copy(update={"image": image}))


async def _exec(sbx: Sandbox, command: str, **kw: object) -> tuple[int, str]:
    res = await sbx.exec(command, timeout=60, **kw)  # type: ignore[arg-type]
    return res.exit_code, res.stdout + res.stderr


def test_a_microvm_boots_a_pulled_debian_without_python(
    vm_settings: Settings, no_python_image: str
) -> None:
    async def go() -> None:
        sbx = await _driver(vm_settings, no_python_image).create(owner="test", limits=Limits())
        try:
            rc, out = await _exec(
                sbx,
                "cat /etc/oci-marker; test -e /etc/issue || echo issue-gone; ls -A /var/cache; "
                "id -u; . /etc/os-release && echo $ID",
            )
            assert (rc, out.split()) == (
                0,
                ["third", "layer", "issue-gone", "oci-only", "1000", "debian"],
            )
            # no Python in the image; the agent runs on the runtime's disk, read-only
            rc, out = await _exec(sbx, "command -v python3 || ls /usr/bin/python3* /opt/ephemeral")
            assert rc != 0, out
            rc, out = await _exec(sbx, "grep ' /.ephemeral ' /proc/mounts", user="root")
            assert rc == 0 and " ro," in out, out
            assert (await _exec(sbx, "touch /.ephemeral/x", user="root"))[0] != 0
            # the root is the image's, writable in the sandbox's own layer only
            rc, out = await _exec(
                sbx, "echo mine > /etc/oci-marker; cat /etc/oci-marker", user="root"
            )
            assert (rc, out) == (0, "mine\n")
            assert (await _exec(sbx, "echo x > /etc/oci-marker", user="worker"))[0] != 0
        finally:
            await sbx.destroy()

    asyncio.run(go())
    store = LayerStore(vm_settings)
    pulled = store.resolve(parse(no_python_image))
    assert pulled is not None
    key = microvm_image.layers_key(x.diff_id.split(":")[1] for x in pulled.layers)
    disk = microvm_image.pulled_disk(vm_settings, key)
    made = disk.stat()
    # the stored layer is unchanged; the disk is made once per digest
    assert any(
        (store.layer_root(layer.diff_id) / "etc/oci-marker").read_text() == "third layer\n"
        for layer in pulled.layers
        if (store.layer_root(layer.diff_id) / "etc/oci-marker").exists()
    )

    async def again() -> str:
        sbx = await _driver(vm_settings, no_python_image).create(owner="test", limits=Limits())
        try:
            return (await _exec(sbx, "cat /etc/oci-marker"))[1]
        finally:
            await sbx.destroy()

    assert asyncio.run(again()) == "third layer\n"  # a fresh sandbox: the write is gone
    assert (disk.stat().st_ino, disk.stat().st_mtime_ns) == (made.st_ino, made.st_mtime_ns)


def test_a_microvm_boots_a_pulled_static_busybox(vm_settings: Settings, busybox_image: str) -> None:
    async def go() -> None:
        sbx = await _driver(vm_settings, busybox_image).create(owner="test", limits=Limits())
        try:
            rc, out = await _exec(sbx, "echo hi; id -u; ls /; ls /lib /usr 2>&1")
            assert rc != 0  # no /lib, no /usr: nothing but busybox
            lines = out.split("\n")
            assert lines[:2] == ["hi", "1000"], out
            assert {"bin", "etc", "tmp", "proc"} <= set(out.split())
            await sbx.put_file("run.sh", b"#!/bin/sh\necho ran $1\n", mode=0o755)
            assert await _exec(sbx, "./run.sh x") == (0, "ran x\n")
            late = await sbx.exec("sleep 100", timeout=1.0)
            assert late.timed_out
            assert await _exec(sbx, "id -u", user="root") == (0, "0\n")
        finally:
            await sbx.destroy()

    asyncio.run(go())


async def test_a_run_and_a_session_on_a_microvm_honour_the_config_and_record_the_digest(
    vm_settings: Settings,
    registry: Registry,
    no_python_image: str,
    tmp_path: Path,
    member_api: Callable[[Settings, str], AbstractAsyncContextManager[MemberApi]],
) -> None:
    """As on the other levels (test_sandbox_boot.py): admission takes a registry reference
    for a microVM, the run records the digest, a session's exec gets the config's Env,
    WorkingDir and User."""
    settings = vm_settings.model_copy(update={"state_dir": tmp_path / "state"})
    # its own state dir holds the registry's credentials too (alone, nothing pulled it before)
    CredentialStore(settings).set(registry.host, Credential(username=USER, password=PASSWORD))
    async with member_api(settings, "id -un; echo $OCI_TEST; pwd") as api:
        seen = await api.run(no_python_image, ISOLATION, timeout_seconds=120)
        assert (seen.row["isolation"], seen.row["image_hash"]) == (ISOLATION, seen.pulled_hex)
        shell = seen.first("shell.executed")
        # a run's commands run as worker in its scratch directory, with the config's Env
        assert shell["stdout"].split()[:2] == ["worker", "from-config"], shell

        command = "pwd; id -un; echo $OCI_TEST"
        answer = await api.session_exec(no_python_image, ISOLATION, 120, command)
        assert answer["stdout"] == "/srv/app\nworker\nfrom-config\n", answer


def test_a_microvm_boots_a_dockerfile_image_built_from_a_registry_image(
    vm_settings: Settings, busybox_image: str, tmp_path: Path
) -> None:
    """Built FROM the busybox image: the base's stored layers plus the build's, one disk."""
    from ephemeral.sandbox.dockerfile import build_dockerfile

    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text(
        f"FROM {busybox_image}\nRUN echo built > /marker && rm /etc/group\n"
    )
    built = build_dockerfile(context / "Dockerfile", name="vm-from-busybox", settings=vm_settings)
    assert built.pulled

    async def go() -> tuple[int, str]:
        sbx = await _driver(vm_settings, "vm-from-busybox").create(owner="test", limits=Limits())
        try:
            return await _exec(sbx, "cat /marker; test -e /etc/group || echo group-gone")
        finally:
            await sbx.destroy()

    assert asyncio.run(go()) == (0, "built\ngroup-gone\n")
