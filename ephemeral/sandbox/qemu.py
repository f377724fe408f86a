"""One QEMU ``-M microvm`` process: its argv, its channels, its console, and killing it.

The VM definition lives here and nowhere else: no NIC (no ``-netdev``/``-nic``, and
``-nodefaults`` removes the default one), the image's disk and the agent runtime's disk
``readonly=on``, and two virtio-serial
ports whose unix sockets the host listens on before QEMU starts (QEMU connects as a client):
``sbx`` for the guest agent and ``ctl`` for stage 2. The console goes to a pipe that is drained
into a bounded buffer, so a chatty guest costs CPU, never host memory or disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from ephemeral import errors
from ephemeral.sandbox import sidechannel
from ephemeral.sandbox.microvm_image import BootArtifacts

Accel = Literal["kvm", "tcg"]
Channel = tuple[asyncio.StreamReader, asyncio.StreamWriter]
CHANNELS = ("agent", "ctl")  # virtio-serial ports "sbx" (the agent) and "ctl" (stage 2)
QEMU = "qemu-system-x86_64"
CONSOLE_KEEP = 64 * 1024
RUN_PLACEHOLDER = "@RUN@"

_qemu_version: str | None = None


def qemu_version() -> str:
    global _qemu_version
    if _qemu_version is None:
        path = shutil.which(QEMU)
        if path is None:
            raise errors.IsolationUnavailable(
                f"{QEMU} is not installed (apt-get install qemu-system-x86)"
            )
        out = subprocess.run([path, "--version"], capture_output=True, timeout=10, check=False)
        lines = out.stdout.decode(errors="replace").strip().splitlines()
        _qemu_version = lines[0][:200] if lines else "unknown"
    return _qemu_version


def host_tsc_khz(cache: Path) -> int:
    """The host's TSC rate, which TCG's guest TSC follows (calibrating against the PIT hangs).

    Read once and kept: it is part of the argv and so of the snapshot key, and ``cpu MHz``
    drifts on hosts with frequency scaling."""
    memo = cache / "host-tsc-khz"
    try:
        return int(memo.read_text())
    except (OSError, ValueError):
        pass
    khz = 2_000_000
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                khz = round(float(line.split(":", 1)[1])) * 1000
                break
    except (OSError, ValueError):
        pass
    try:
        cache.mkdir(parents=True, exist_ok=True)
        memo.write_text(str(khz))
    except OSError:
        pass  # a read-only cache: the value is still right for this process
    return khz


def kvm_pvm_hint() -> str:
    if Path("/sys/module/kvm_pvm").exists():
        return " (/dev/kvm is kvm_pvm: stock guest kernels crash or crawl under it)"
    return ""


def kvm_unavailable_reason() -> str | None:
    if not os.path.exists("/dev/kvm"):
        return "no /dev/kvm"
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"/dev/kvm cannot be opened: {exc.strerror}"
    os.close(fd)
    return None


# ---------------------------------------------------------------------------- argv


def qemu_argv(
    accel: Accel,
    art: BootArtifacts,
    *,
    memory_mib: int,
    vcpus: int,
    kernel_args: str,
    disk: bool = True,
    tsc_khz: int | None = None,
) -> list[str]:
    """The VM definition; RUN_PLACEHOLDER stands for the per-VM socket directory."""
    if accel == "kvm":
        machine = [
            "-M",
            "microvm,x-option-roms=off,pit=off,pic=off,rtc=off,isa-serial=on",
            "-enable-kvm",
            "-cpu",
            "host,-arch-capabilities",
        ]
    else:
        # TCG needs the PIT: without kvm-clock there is no other clocksource.
        machine = ["-M", "microvm,x-option-roms=off,isa-serial=on", "-accel", "tcg", "-cpu", "max"]
        kernel_args += f" tsc_early_khz={tsc_khz or 2_000_000}"
    argv = [
        QEMU,
        *machine,
        "-m",
        str(memory_mib),
        "-smp",
        str(vcpus),
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-kernel",
        str(art.kernel.vmlinuz),
        "-initrd",
        str(art.initrd),
        "-chardev",
        "stdio,id=con,signal=off",
        "-serial",
        "chardev:con",
    ]
    if disk:
        # stage 0 tells the disks apart by serial (virtio-mmio probe order is not fixed)
        disks = [("root", art.rootfs_ext4)]
        if art.agent_disk is not None:
            disks.append(("agent", art.agent_disk))
        for name, path in disks:
            argv += [
                "-drive",
                f"id={name},file={path},format=raw,if=none,readonly=on,cache=unsafe",
                "-device",
                f"virtio-blk-device,drive={name},serial=ephemeral-{name}",
            ]
    argv += [
        "-device",
        "virtio-serial-device,max_ports=3",
        "-chardev",
        f"socket,id=agent,path={RUN_PLACEHOLDER}/agent.sock",
        "-device",
        "virtserialport,chardev=agent,name=sbx,nr=1",
        "-chardev",
        f"socket,id=ctl,path={RUN_PLACEHOLDER}/ctl.sock",
        "-device",
        "virtserialport,chardev=ctl,name=ctl,nr=2",
        "-append",
        kernel_args,
    ]
    return argv


def bind_run_dir(argv: list[str], run_dir: Path) -> list[str]:
    return [a.replace(RUN_PLACEHOLDER, str(run_dir)) for a in argv]


# ---------------------------------------------------------------------------- one QEMU process


class QemuProcess:
    """A QEMU child in its own process group, its console drained into a bounded buffer."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.proc: asyncio.subprocess.Process | None = None
        self.console = bytearray()
        self.stderr = bytearray()
        self._drains: list[asyncio.Task[None]] = []
        self._listeners: dict[str, socket.socket] = {}

    def listen(self, *names: str) -> None:
        """The host ends of the channels exist before QEMU, which connects to them as a client."""
        for name in names:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(self.run_dir / f"{name}.sock"))
            sock.listen(1)
            sock.setblocking(False)
            self._listeners[name] = sock

    async def spawn(self, argv: list[str], on_pid: Callable[[int], None] | None = None) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            cwd=str(self.run_dir),
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
        )
        if on_pid is not None:
            on_pid(self.proc.pid)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._drains = [
            asyncio.create_task(_drain(self.proc.stdout, self.console)),
            asyncio.create_task(_drain(self.proc.stderr, self.stderr)),
        ]

    async def accept(self, timeout: float) -> dict[str, Channel]:
        """QEMU's connection to every listening channel, or SandboxError if QEMU dies or stalls."""
        assert self.proc is not None
        loop = asyncio.get_running_loop()
        names = list(self._listeners)
        accepts = asyncio.ensure_future(
            asyncio.gather(*(loop.sock_accept(self._listeners[n]) for n in names))
        )
        died = asyncio.ensure_future(self.proc.wait())
        waiting: set[asyncio.Future[Any]] = {accepts, died}
        try:
            done, _ = await asyncio.wait(
                waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for t in (accepts, died):
                if not t.done():
                    t.cancel()
        if accepts in done:
            channels: dict[str, Channel] = {}
            for name, (conn, _) in zip(names, accepts.result(), strict=True):
                self._listeners.pop(name).close()
                channels[name] = await asyncio.open_unix_connection(sock=conn)
            return channels
        await asyncio.sleep(0.05)
        if died in done:
            raise errors.SandboxError(f"QEMU exited ({self.proc.returncode}): {self.diagnostics()}")
        raise errors.SandboxError(f"QEMU did not connect its channels in {timeout:.0f}s")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def diagnostics(self, n: int = 1500) -> str:
        err = self.stderr[-n:].decode(errors="replace").strip()
        con = self.console[-n:].decode(errors="replace").strip()
        parts = [f"QEMU said: {err}" if err else "", f"console: {con}" if con else ""]
        return "; ".join(p for p in parts if p) or "no QEMU or console output"

    async def kill(self) -> None:
        """SIGKILL the whole group and reap; idempotent, never raises."""
        for sock in self._listeners.values():
            sock.close()
        self._listeners.clear()
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                await self.proc.wait()
        for t in self._drains:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(t, 2.0)


async def _drain(stream: asyncio.StreamReader, buf: bytearray) -> None:
    # The console is the guest's to write: read at a bounded rate (see sidechannel.py).
    await sidechannel.drain(stream, buf, keep=CONSOLE_KEEP)


def new_run_dir() -> Path:
    # Short and private: unix socket paths are capped at 108 bytes.
    return Path(tempfile.mkdtemp(prefix="ephemeral-vm-"))
