"""Sandbox fixtures: a session-built image, drivers that really start here, and a factory that
destroys every sandbox at teardown and attaches the runtime's log to a failing test's report."""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.sandbox import images, registry
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


@pytest.fixture(params=DRIVERS)
def driver(
    request: pytest.FixtureRequest, sandbox_settings: Settings, rootfs: Path
) -> SandboxDriver:
    iso: str = request.param
    why = _availability_of(iso, sandbox_settings)
    if why is not None:
        unavailable(f"{iso} cannot run here: {why}", iso)
    return registry.get_driver(iso, sandbox_settings)


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
