"""A runtime gets its stdio and nothing else of the server's fd table, on uvloop too.

``ephemeral serve`` runs on uvloop, whose spawn ignores ``close_fds`` and left the child ends of
its stdio socketpairs open in the runtime; runsc then failed boots whenever one of them was fd
256 ("unable to remap stdios", "cannot read client sync file: EOF"). See spawn.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvloop

from ephemeral.sandbox.base import Limits, SandboxDriver
from ephemeral.sandbox.process import ProcessSandbox
from tests.drivers import unavailable
from tests.sandbox.conftest import _availability_of

pytestmark = pytest.mark.timeout(300)


@contextmanager
def busy_fd_table(upto: int) -> Iterator[None]:
    """Hold sockets until the next fd the process opens is ``upto``, as a busy server does."""
    held: list[socket.socket] = []
    try:
        while True:
            probe = os.open(os.devnull, os.O_RDONLY)
            os.close(probe)
            if probe >= upto:
                break
            held.append(socket.socket())
        yield
    finally:
        for s in held:
            s.close()


def fd_targets(pid: int) -> dict[int, str]:
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed while we looked
    return out


@pytest.mark.parametrize("isolation", ["namespaces", "gvisor"])
def test_runtime_inherits_only_its_stdio_under_uvloop(isolation: str, sandbox_settings, rootfs):
    why = _availability_of(isolation, sandbox_settings)
    if why is not None:
        unavailable(f"{isolation} cannot run here: {why}", isolation)
    from ephemeral.sandbox.registry import get_driver

    driver = get_driver(isolation, sandbox_settings)

    async def check() -> None:
        with busy_fd_table(300):
            sbx = await driver.create(owner="test", limits=Limits(lifetime_seconds=60))
        try:
            assert isinstance(sbx, ProcessSandbox) and sbx._proc is not None
            fds = fd_targets(sbx._proc.pid)  # the runtime (sh exec'd into bwrap / runsc)
            stdio = {fds[0], fds[1], fds[2]}
            assert all(t.startswith("pipe:") for t in stdio), fds
            # nothing above stdio is a second handle on it (libuv's leaked child ends were)
            assert not [n for n, t in fds.items() if n > 2 and t in stdio], fds
            res = await sbx.exec(["python3", "-V"], timeout=30)
            assert res.exit_code == 0
        finally:
            await sbx.destroy()

    uvloop.run(check())


def test_gvisor_burst_under_uvloop_all_interactive(sandbox_settings, rootfs):
    """A burst of creates at once from a uvloop server whose fd numbers run past 256: every
    sandbox boots (no 'unable to remap stdios') and answers its first exec."""
    why = _availability_of("gvisor", sandbox_settings)
    if why is not None:
        unavailable(f"gvisor cannot run here: {why}", "gvisor")
    from ephemeral.sandbox.registry import get_driver

    driver: SandboxDriver = get_driver("gvisor", sandbox_settings)
    n = 12

    async def one() -> int:
        sbx = await driver.create(owner="test", limits=Limits(lifetime_seconds=240))
        try:
            return (await sbx.exec(["python3", "-V"], timeout=60)).exit_code
        finally:
            await sbx.destroy()

    async def burst() -> list[int | BaseException]:
        # the spawns of the burst take the fds from ~240 upwards, through 256
        with busy_fd_table(240):
            return await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)

    got = uvloop.run(burst())
    assert got == [0] * n, [str(g)[:300] for g in got if g != 0]
