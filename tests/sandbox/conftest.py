"""Sandbox fixtures: a session-built image, drivers that really start here, and a factory that
destroys every sandbox at teardown and attaches the runtime's log to a failing test's report.

Besides ``default``, two images made here from nothing of ours, registered as any rootfs is
(``images.register_rootfs``): ``busybox_image``, only Debian's static busybox (``/bin`` and
``/etc/passwd``: no libc, no Python, not even ``/tmp``), and ``no_python_image``, the
``default`` rootfs without Python or our agent (a Debian minbase as a slim image is)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.sandbox import agent_runtime, images, registry
from ephemeral.sandbox.base import Limits, Sandbox, SandboxDriver
from ephemeral.settings import Settings
from tests.drivers import unavailable
from tests.sandbox.leaks import Footprint, footprint, leftovers

# microvm-tcg emulates a whole machine in software: ~10x slower per test, so it is `slow`
DRIVERS = ["namespaces", "gvisor", pytest.param("microvm-tcg", marks=pytest.mark.slow)]
_availability: dict[str, str | None] = {}


@pytest.fixture(scope="session")
def sandbox_settings() -> Iterator[Settings]:
    """One state dir for the session's sandboxes; the image cache is the shared one."""
    state = Path(tempfile.mkdtemp(prefix="ephemeral-sbx-tests-"))
    yield Settings.load(state_dir=state, use_prefect=False)
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session")
def rootfs(sandbox_settings: Settings) -> Path:
    if shutil.which("mmdebstrap") is None and images.built_rootfs(sandbox_settings) is None:
        unavailable("no image built and mmdebstrap missing (make setup)")
    return asyncio.run(images.ensure_image(sandbox_settings))


def _availability_of(isolation: str, settings: Settings) -> str | None:
    if isolation not in _availability:
        if isolation.startswith("microvm") and not registry.microvm_available():
            _availability[isolation] = "ephemeral.sandbox.microvm is not installed"
        else:
            _availability[isolation] = _run_probe(isolation, settings)
    return _availability[isolation]


def _run_probe(isolation: str, settings: Settings) -> str | None:
    """Probe with a loop of its own: async tests ask too, from inside their running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(registry.probe_level(isolation, settings))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, registry.probe_level(isolation, settings)).result()


def driver_for(iso: str, settings: Settings, image: str | None = None) -> SandboxDriver:
    """The driver of ``iso`` (of image ``image`` when given), or the test skips with the reason."""
    why = _availability_of(iso, settings)
    if why is not None:
        unavailable(f"{iso} cannot run here: {why}", iso)
    if image is not None:
        settings = settings.model_copy(update={"image": image})
    return registry.get_driver(iso, settings)


@pytest.fixture(params=DRIVERS)
def driver(
    request: pytest.FixtureRequest, sandbox_settings: Settings, rootfs: Path
) -> SandboxDriver:
    return driver_for(request.param, sandbox_settings)


def _register(settings: Settings, kind: str, tree: Path) -> Iterator[str]:
    """Register ``tree`` as an image of a name of this test process; unregister it after."""
    name = f"test-{kind}-{os.getpid()}"
    images.register_rootfs(settings, name, tree, digest=f"test:{tree}")
    try:
        yield name
    finally:
        images.remove_images(settings, name)
        shutil.rmtree(tree.parent, ignore_errors=True)


def busybox_tree(root: Path) -> None:
    """A rootfs of Debian's static busybox: its applets in /bin, a passwd and a group file."""
    busybox = Path("/bin/busybox")
    if not busybox.is_file() or not agent_runtime.static(busybox):
        unavailable("no static /bin/busybox (make setup installs busybox-static)")
    (root / "bin").mkdir(parents=True)
    shutil.copy2(busybox, root / "bin" / "busybox")
    applets = subprocess.run([busybox, "--list"], capture_output=True, check=True, text=True)
    for applet in applets.stdout.split():
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nworker:x:1000:1000:worker:/home/worker:/bin/sh\n"
    )
    (root / "etc" / "group").write_text("root:x:0:\nworker:x:1000:\n")
    root.chmod(0o755)


@pytest.fixture(scope="session")
def busybox_image(sandbox_settings: Settings, rootfs: Path) -> Iterator[str]:
    tree = Path(tempfile.mkdtemp(prefix="ephemeral-busybox-")) / "rootfs"
    busybox_tree(tree)
    yield from _register(sandbox_settings, "busybox", tree)


@pytest.fixture(scope="session")
def no_python_image(sandbox_settings: Settings, rootfs: Path) -> Iterator[str]:
    tree = Path(tempfile.mkdtemp(prefix="ephemeral-nopython-")) / "rootfs"
    subprocess.run(["cp", "-a", "--reflink=auto", str(rootfs), str(tree)], check=True)
    for pattern in ("usr/bin/python3*", "usr/lib/python3*", "opt/ephemeral"):
        for p in tree.glob(pattern):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    yield from _register(sandbox_settings, "nopython", tree)


Factory = Callable[..., Awaitable[Sandbox]]


@pytest.fixture
async def make_sandbox(
    request: pytest.FixtureRequest, driver: SandboxDriver, sandbox_settings: Settings
) -> AsyncIterator[Factory]:
    made: list[tuple[Sandbox, Footprint]] = []

    async def factory(**limits: float) -> Sandbox:
        sbx = await driver.create(owner="test", limits=Limits(**limits))
        made.append((sbx, footprint(sbx, sandbox_settings.sandboxes_dir)))
        return sbx

    yield factory
    logs = []
    left: list[str] = []
    for sbx, fp in made:
        tail = getattr(sbx, "log_tail", None)
        if tail is not None:
            logs.append(f"--- {sbx.isolation} {sbx.id}\n{tail(4000)}")
        try:
            await sbx.destroy()
        except errors.SandboxError as exc:  # still report the test's own failure first
            logs.append(f"destroy failed: {exc}")
        left += [f"{sbx.id}: {what}" for what in leftovers(fp)]
    if logs:
        request.node.add_report_section("teardown", "sandbox logs", "\n".join(logs))
    assert not left, "destroyed sandboxes left things on the host:\n" + "\n".join(left)
