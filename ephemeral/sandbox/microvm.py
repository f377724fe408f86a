"""``microvm-kvm`` / ``microvm-tcg`` isolation: QEMU ``-M microvm`` started from a memory snapshot.

Each sandbox is one QEMU process: Debian's cloud kernel, the stage0 initramfs, the image's disk
(a built image's ext4 root, or a pulled image's layers in one ext4) and the agent runtime's
disk, both attached ``readonly=on`` (every guest write lands in a tmpfs overlay in guest RAM),
no NIC (no ``-netdev``/``-nic`` at all), and the guest agent, on the runtime's own loader and
python, on a virtio-serial port named ``sbx`` that QEMU connects to a unix socket the host
listens on.

Cold boots are paid once per (image, kernel, QEMU, memory, vCPUs): boot, wait for the agent's
hello, save the whole VM with QMP ``migrate`` to a file, check the file by restoring it once.
Every ``create()`` then starts QEMU with the same argv plus ``-incoming "exec:cat <file>"`` and
fresh sockets, reseeds the guest RNG first thing (every restore starts from the same RNG
state), and meanwhile sends the sandbox's overlay size and process limit to stage 2 (the
guest's PID 1, saved waiting on a second port, ``ctl``). Memory and vCPUs cannot change after
boot, so they are part of the snapshot key; the wall-clock lifetime is the host's.

QEMU never outlives its sandbox: destroy and every failed start kill its process group, the
handle file lets the reaper do the same after a crash, and if the host process dies the agent
socket closes, the agent reads EOF and exits, and the guest's reboot ends QEMU (``-no-reboot``).

Under TCG (no hardware virtualisation) this is emulation, not a security boundary, so
``microvm-tcg`` exists for exercising this code path and is never picked by ``auto``. Cold TCG
boots used to hang in TSC calibration against the PIT; ``tsc_early_khz`` skips that.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from ephemeral import errors
from ephemeral.sandbox import agent_runtime, handles, images, microvm_image
from ephemeral.sandbox import protocol as p
from ephemeral.sandbox.base import Handle, Limits, Sandbox
from ephemeral.sandbox.guest import GuestBacked, GuestClient
from ephemeral.sandbox.microvm_image import BootArtifacts
from ephemeral.sandbox.process import new_handle
from ephemeral.sandbox.qemu import (
    CHANNELS,
    CONSOLE_KEEP,
    QEMU,
    Accel,
    Channel,
    QemuProcess,
    bind_run_dir,
    host_tsc_khz,
    kvm_pvm_hint,
    kvm_unavailable_reason,
    new_run_dir,
    qemu_argv,
    qemu_version,
)
from ephemeral.sandbox.qmp import QMPClient
from ephemeral.settings import Settings

BOOT_ATTEMPTS = 6
BOOT_DEADLINE = {"kvm": 20.0, "tcg": 40.0}
PROBE_DEADLINE = {"kvm": 10.0, "tcg": 30.0}  # KVM reaches init in well under 1 s
RESTORE_DEADLINE = 30.0
PROBE_TTL_S = 24 * 3600.0
PROBE_CREATE_S = 300.0  # may include the one cold boot + snapshot of a fresh image
SETTLE_SECONDS = 0.5  # let the guest go idle after hello, so the saved state is quiescent
RESEED_BYTES = 64
BOOT_LIMITS = Limits()  # the disk and pids a VM boots with; a restore may change them

KERNEL_ARGS = (
    "console=ttyS0 quiet panic=-1 reboot=t no_timer_check tsc=reliable random.trust_cpu=on "
    "i8042.noaux i8042.nomux i8042.nopnp i8042.nokbd cryptomgr.notests nowatchdog 8250.nr_uarts=1"
)


class SnapshotMeta(BaseModel):
    key: str
    hello: p.Hello
    qemu: str
    kernel: str
    boot_attempts: int
    boot_ms: int
    save_ms: int
    size_bytes: int
    built_at: float


@dataclass(frozen=True)
class Snapshot:
    state: Path
    argv: list[str]  # with RUN_PLACEHOLDER for the per-sandbox directory
    meta: SnapshotMeta


# Per process: drivers are cheap objects made per request; what they find on disk is not.
_ARTIFACTS: dict[tuple[str, str, str], BootArtifacts] = {}
_SNAPSHOTS: dict[str, Snapshot] = {}


def _exist(*paths: Path) -> bool:
    return all(p.exists() for p in paths)


# ---------------------------------------------------------------------------- the sandbox


class MicroVMSandbox(GuestBacked):
    def __init__(
        self,
        *,
        sandbox_id: str,
        isolation: str,
        image: str,
        handle: Handle,
        handle_file: Path,
        qemu: QemuProcess,
        limits: Limits,
    ) -> None:
        super().__init__(
            sandbox_id=sandbox_id,
            isolation=isolation,
            image=image,
            runtime=qemu_version(),  # cached after the first call
            owner=handle.owner,
            limits=limits,
            handle=handle,
            handle_file=handle_file,
        )
        self._handle: Handle = handle
        self._handle_file: Path = handle_file
        self._qemu = qemu
        self._writer: asyncio.StreamWriter | None = None

    @property
    def qemu_pid(self) -> int | None:
        return self._qemu.proc.pid if self._qemu.proc is not None else None

    @property
    def host_pids(self) -> set[int]:
        return {self._qemu.proc.pid} if self._qemu.alive() and self._qemu.proc else set()

    def log_tail(self, n: int = CONSOLE_KEEP) -> str:
        return self._qemu.diagnostics(n)

    def _running(self) -> bool:
        return self._client is not None and self._qemu.alive()

    async def _restore(self, snap: Snapshot) -> None:
        t0 = time.monotonic()
        run_dir = self._qemu.run_dir
        self._qemu.listen(*CHANNELS)

        def persist(pid: int) -> None:
            self._handle.pgid = pid
            self._handle.pids = [pid]
            handles.write(self._handle_file.parent, self._handle)

        await self._qemu.spawn(
            [*bind_run_dir(snap.argv, run_dir), "-incoming", f"exec:cat {snap.state}"], persist
        )
        channels = await self._qemu.accept(RESTORE_DEADLINE)
        reader, writer = channels["agent"]
        self._writer = writer
        client = GuestClient(reader, writer, label=self.id)
        # The hello was said before the snapshot; every restore resumes right after it.
        client.hello = snap.meta.hello
        # Every restore shares the saved RNG state: fresh host entropy before anything else;
        # meanwhile stage 2 applies this sandbox's own limits to the saved VM.
        try:
            credited, _ = await asyncio.wait_for(
                asyncio.gather(
                    client.reseed(os.urandom(RESEED_BYTES)),
                    _configure(channels["ctl"], self.limits),
                ),
                RESTORE_DEADLINE,
            )
        except (errors.SandboxError, TimeoutError) as exc:
            raise errors.SandboxError(
                f"restored microVM did not answer: {exc}; {self._qemu.diagnostics()}"
            ) from exc
        if not credited:
            # Without a forced reseed this VM would share its random numbers with every other.
            raise errors.SandboxError("restored microVM could not reseed its RNG")
        self._client = client
        self.workdir = snap.meta.hello.workdir
        self.boot_ms = int((time.monotonic() - t0) * 1000)
        self._start_lifetime()

    async def _teardown(self) -> None:
        if self._writer is not None:
            self._writer.close()
        await self._qemu.kill()


# ---------------------------------------------------------------------------- the driver


class MicroVMDriver:
    """One accelerator's microVMs. ``MicroVMDriver(settings, "kvm")`` is ``microvm-kvm``."""

    def __init__(self, settings: Settings, accel: Accel = "kvm") -> None:
        self.settings = settings
        self.accel: Accel = accel
        self.isolation = f"microvm-{accel}"
        self._artifacts: BootArtifacts | None = None
        self._agent = ""  # the agent's kernel arguments (_agent_args), once the runtime is known

    # ---- artifacts

    async def artifacts(self) -> BootArtifacts:
        """The image's disk (a built rootfs, or a pulled image's layers), then kernel +
        initramfs, and the agent runtime's disk (all cached by hash)."""
        if self._artifacts is None:
            from ephemeral.oci import sandbox_image

            name = self.settings.image
            if sandbox_image.is_reference(name):
                config: images.ImageConfig | None = await sandbox_image.ensure(self.settings, name)
            else:
                rootfs = await images.ensure_image(self.settings, name)
                config = images.built_image(self.settings, name)
            if config is not None and config.pulled:  # a registry image, or built FROM one
                art = await self._layered_artifacts(config)
            else:
                image_hash = images.image_dir(self.settings, name).name.rsplit("-", 1)[-1]
                memo_key = (str(self.settings.image_cache_dir), name, image_hash)
                found = _ARTIFACTS.get(memo_key)
                if found is None or not _exist(
                    found.rootfs_ext4, found.initrd, found.kernel.vmlinuz
                ):
                    found = await asyncio.to_thread(
                        microvm_image.ensure_boot_artifacts, self.settings, name, rootfs, image_hash
                    )
                    _ARTIFACTS[memo_key] = found
                art = found
            # our side of the sandbox runs on the agent runtime whatever the image holds
            runtime = await agent_runtime.ensure_runtime(self.settings)
            disk = await asyncio.to_thread(
                microvm_image.ensure_runtime_disk, self.settings, runtime.root
            )
            self._agent = _agent_args(runtime)
            self._artifacts = dataclasses.replace(
                art, agent_disk=disk, key=hashlib.sha256(f"{art.key}|{disk}".encode()).hexdigest()
            )
        return self._artifacts

    async def _layered_artifacts(self, config: images.ImageConfig) -> BootArtifacts:
        """An image made of stored layers (a registry image, or a Dockerfile image built FROM
        one) as one disk of its layers, made once per list of layers
        (``microvm_image.build_layered_ext4``). Its layers are listed lowest first with our
        agent's layer last (``ImageConfig.layers``), which a microVM does not need."""
        memo_key = (str(self.settings.image_cache_dir), "@layers", config.hash)
        art = _ARTIFACTS.get(memo_key)
        if art is None or not _exist(art.rootfs_ext4, art.initrd, art.kernel.vmlinuz):
            art = await asyncio.to_thread(
                microvm_image.ensure_pulled_artifacts, self.settings, config.layers[:-1]
            )
            _ARTIFACTS[memo_key] = art
        mark_used_file(art.rootfs_ext4)
        return art

    def _kernel_args(self, limits: Limits, art: BootArtifacts) -> str:
        # Only the defaults for disk and pids: stage 2 applies each sandbox's own after every
        # restore (_configure), so they are not part of the snapshot key.
        return (
            f"{KERNEL_ARGS} {self._agent} ephemeral.layers={art.layers} "
            f"ephemeral.overlay={BOOT_LIMITS.disk_mib}m ephemeral.pids={BOOT_LIMITS.pids}"
        )

    @staticmethod
    def vcpus(limits: Limits) -> int:
        return max(1, min(os.cpu_count() or 1, math.ceil(limits.cpus)))

    def _argv(self, art: BootArtifacts, limits: Limits) -> list[str]:
        return qemu_argv(
            self.accel,
            art,
            memory_mib=limits.memory_mib,
            vcpus=self.vcpus(limits),
            kernel_args=self._kernel_args(limits, art),
            tsc_khz=host_tsc_khz(microvm_image.microvm_cache(self.settings)),
        )

    # ---- snapshots

    async def snapshot(self, limits: Limits) -> Snapshot:
        """The saved VM for these limits; cold-boots and saves it if it is not cached."""
        art = await self.artifacts()
        argv = self._argv(art, limits)
        ext4 = art.rootfs_ext4.stat()
        key = hashlib.sha256(
            json.dumps([argv, qemu_version(), art.key, ext4.st_size, ext4.st_mtime_ns]).encode()
        ).hexdigest()[:20]
        memo = _SNAPSHOTS.get(key)
        if memo is not None and _exist(memo.state):
            return memo
        snap_dir = microvm_image.microvm_cache(self.settings) / "snapshots" / key
        snap = _load_snapshot(snap_dir, argv)
        if snap is None:
            # One cold boot at a time across processes: they would only compete for the cores.
            async with _FileLock(snap_dir.parent / ".build.lock"):
                snap = _load_snapshot(snap_dir, argv)
                if snap is None:
                    snap = await self._build_snapshot(snap_dir, key, argv, art)
        _SNAPSHOTS[key] = snap
        return snap

    async def _build_snapshot(
        self, snap_dir: Path, key: str, argv: list[str], art: BootArtifacts
    ) -> Snapshot:
        if any(c in str(snap_dir) for c in " '\"\\$`;&|<>\n"):
            raise errors.SandboxError(f"microvm: cache path {snap_dir} is unusable in exec: URIs")
        partial = snap_dir.with_name(snap_dir.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        failures: list[str] = []
        for attempt in range(1, BOOT_ATTEMPTS + 1):
            try:
                meta = await self._boot_and_save(argv, partial / "state.bin", key, attempt, art)
                break
            except errors.SandboxError as exc:
                failures.append(f"attempt {attempt}: {exc.detail[-600:]}")
        else:
            shutil.rmtree(partial, ignore_errors=True)
            raise errors.SandboxError(
                f"{self.isolation}: no cold boot reached the agent in {BOOT_ATTEMPTS} tries; "
                + " | ".join(failures[-2:])
            )
        (partial / "argv.json").write_text(json.dumps(argv))
        (partial / "meta.json").write_text(meta.model_dump_json(indent=1))
        snap = Snapshot(state=snap_dir / "state.bin", argv=argv, meta=meta)
        shutil.rmtree(snap_dir, ignore_errors=True)
        partial.rename(snap_dir)
        # A snapshot that does not restore must not be published: try it once.
        probe_sbx = await self._restore(snap, owner="snapshot-check", limits=Limits())
        try:
            res = await probe_sbx.exec(["true"], timeout=20)
            if res.exit_code != 0:
                raise errors.SandboxError(f"restored snapshot: `true` exited {res.exit_code}")
        except errors.SandboxError:
            shutil.rmtree(snap_dir, ignore_errors=True)
            raise
        finally:
            await probe_sbx.destroy()
        return snap

    async def _boot_and_save(
        self, argv: list[str], state: Path, key: str, attempt: int, art: BootArtifacts
    ) -> SnapshotMeta:
        run_dir = new_run_dir()
        qemu = QemuProcess(run_dir)
        t0 = time.monotonic()
        deadline = BOOT_DEADLINE[self.accel]
        try:
            qemu.listen(*CHANNELS)
            await qemu.spawn(
                [
                    *bind_run_dir(argv, run_dir),
                    "-qmp",
                    f"unix:{run_dir}/qmp.sock,server=on,wait=off",
                ]
            )
            # ctl stays connected and silent: stage 2 is saved waiting on it
            channels = await qemu.accept(10.0)
            reader, writer = channels["agent"]
            client = GuestClient(reader, writer, label=f"snapshot-{key}")
            left = deadline - (time.monotonic() - t0)
            try:
                hello = await client.handshake(max(1.0, left))
            except errors.SandboxError as exc:
                raise errors.SandboxError(f"{exc.detail}; {qemu.diagnostics(600)}") from exc
            boot_ms = int((time.monotonic() - t0) * 1000)
            await asyncio.sleep(SETTLE_SECONDS)
            t1 = time.monotonic()
            qmp = await QMPClient.connect(run_dir / "qmp.sock")
            try:
                await qmp.migrate_to_file(state, timeout=120)
            finally:
                await qmp.close()
            save_ms = int((time.monotonic() - t1) * 1000)
            for _, w in channels.values():
                w.close()
            return SnapshotMeta(
                key=key,
                hello=hello,
                qemu=qemu_version(),
                kernel=art.kernel.version,
                boot_attempts=attempt,
                boot_ms=boot_ms,
                save_ms=save_ms,
                size_bytes=os.stat(state).st_size,
                built_at=time.time(),
            )
        finally:
            await qemu.kill()
            shutil.rmtree(run_dir, ignore_errors=True)

    # ---- the SandboxDriver protocol

    async def probe(self) -> str | None:
        """None only if a guest really boots under this accelerator and runs ``true``."""
        if shutil.which(QEMU) is None:
            return f"{self.isolation}: {QEMU} is not installed"
        if self.accel == "kvm":
            why = kvm_unavailable_reason()
            if why:
                return f"microvm-kvm: {why}"
            # Fail in seconds, without building an image, where /dev/kvm cannot run the kernel.
            try:
                why = await self.boot_probe()
            except errors.EphemeralError as exc:
                return f"{self.isolation}: {exc.detail}"
            if why:
                return f"{self.isolation}: {why}"
        # A real sandbox, with the default limits: their snapshot is the one every caller
        # needs first anyway, so a cold probe pays for no extra cold boot.
        try:
            sbx = await asyncio.wait_for(
                self.create(owner="probe", limits=Limits(lifetime_seconds=120)), PROBE_CREATE_S
            )
        except (errors.EphemeralError, TimeoutError, OSError) as exc:
            return f"{self.isolation}: could not start a sandbox: {exc}"
        try:
            res = await sbx.exec(["true"], timeout=20)
            if res.exit_code != 0:
                return f"{self.isolation}: `true` exited {res.exit_code} in the sandbox"
            return None
        except errors.EphemeralError as exc:
            return f"{self.isolation}: exec failed: {exc}"
        finally:
            await sbx.destroy()

    async def boot_probe(self, *, fresh: bool = False) -> str | None:
        """Boot only the kernel and stage0 (no disk, no agent) under this accelerator.

        Cheap and needs no image: on a host whose /dev/kvm cannot run a stock kernel (kvm_pvm),
        this fails within the deadline instead of after a full image build. The verdict is
        kept for a day in the shared cache, keyed by QEMU, guest kernel, stage0 and host kernel,
        because a failing probe burns a core for the whole deadline."""
        kernel = await asyncio.to_thread(microvm_image.ensure_kernel, self.settings)
        defn = microvm_image.definition_dir(self.settings, _definition_of(self.settings.image))
        key = "|".join(
            [
                qemu_version(),
                kernel.version,
                os.uname().release,
                hashlib.sha256(
                    (defn / "stage0-init.sh").read_bytes() + (defn / "modules.txt").read_bytes()
                ).hexdigest()[:16],
            ]
        )
        memo = microvm_image.microvm_cache(self.settings) / f"boot-probe-{self.accel}.json"
        if not fresh:
            cached = _read_verdict(memo, key)
            if cached is not None:
                return cached[0]
        reason = await self._boot_once(kernel, defn)
        _write_verdict(memo, key, reason)
        return reason

    async def _boot_once(self, kernel: microvm_image.Kernel, defn: Path) -> str | None:
        initrd_bytes = await asyncio.to_thread(microvm_image.build_initramfs, kernel, defn)
        run_dir = new_run_dir()
        qemu = QemuProcess(run_dir)
        try:
            initrd = run_dir / "stage0.cpio.gz"
            initrd.write_bytes(initrd_bytes)
            art = BootArtifacts(
                kernel=kernel, initrd=initrd, rootfs_ext4=Path("/dev/null"), key="probe"
            )
            argv = qemu_argv(
                self.accel,
                art,
                memory_mib=128,
                vcpus=1,
                disk=False,
                kernel_args=f"{KERNEL_ARGS} ephemeral.probe=1",
                tsc_khz=host_tsc_khz(microvm_image.microvm_cache(self.settings)),
            )
            qemu.listen(*CHANNELS)
            await qemu.spawn(bind_run_dir(argv, run_dir))
            deadline = time.monotonic() + PROBE_DEADLINE[self.accel]
            assert qemu.proc is not None
            while time.monotonic() < deadline:
                if b"EPHEMERAL-PROBE-OK" in qemu.console:
                    return None
                if not qemu.alive():
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.05)
            if b"EPHEMERAL-PROBE-OK" in qemu.console:
                return None
            state = (
                "exited"
                if not qemu.alive()
                else f"did not reach init within {PROBE_DEADLINE[self.accel]:.0f}s"
            )
            hint = kvm_pvm_hint() if self.accel == "kvm" else ""
            return f"guest kernel {state}{hint}; {qemu.diagnostics(400)}"
        finally:
            await qemu.kill()
            shutil.rmtree(run_dir, ignore_errors=True)

    async def create(self, *, owner: str, limits: Limits) -> Sandbox:
        snap = await self.snapshot(limits)
        return await self._restore(snap, owner=owner, limits=limits)

    async def _restore(self, snap: Snapshot, *, owner: str, limits: Limits) -> MicroVMSandbox:
        handle = new_handle(self.isolation, owner)
        run_dir = new_run_dir()
        handle.paths = [str(run_dir)]
        handle_file = handles.write(self.settings.sandboxes_dir, handle)
        sbx = MicroVMSandbox(
            sandbox_id=handle.id,
            isolation=self.isolation,
            image=self.settings.image,
            handle=handle,
            handle_file=handle_file,
            qemu=QemuProcess(run_dir),
            limits=limits,
        )
        try:
            await sbx._restore(snap)
        except BaseException:
            # Never leak a QEMU (it would keep burning a core): kill it on any failure.
            await sbx.destroy()
            raise
        return sbx


def _agent_args(runtime: agent_runtime.AgentRuntime) -> str:
    """The agent's command line and environment as stage 0 reads them from the kernel's
    command line: comma-separated words, so none may hold a comma or a blank."""
    argv = runtime.argv()
    words = {
        "python": argv[:-1],
        "agent": argv[-1:],
        "env": [f"{k}={v}" for k, v in agent_runtime.ENV.items()],
    }
    for part in (w for ws in words.values() for w in ws):
        if not part or any(c in part for c in ", \t\n'\"\\"):
            raise errors.SandboxError(f"microvm: the agent's word {part!r} cannot be passed to it")
    return " ".join(f"ephemeral.{k}={','.join(v)}" for k, v in words.items())


def _definition_of(image: str) -> str:
    """The image whose boot definition boots ``image`` (a pulled image has none of its own)."""
    from ephemeral.oci.sandbox_image import is_reference

    return microvm_image.PULLED_DEFINITION if is_reference(image) else image


def mark_used_file(path: Path) -> None:
    """A disk's use, as ``images gc`` reads it: ``<disk>.used``'s mtime (the disk's own is part
    of the snapshot's key). Best effort: a read-only cache still boots."""
    with contextlib.suppress(OSError):
        path.with_name(path.name + ".used").touch()


async def _configure(ctl: Channel, limits: Limits) -> None:
    """Send this sandbox's overlay size and process limit to stage 2; wait for its "ok"."""
    reader, writer = ctl
    size = "-" if limits.disk_mib == BOOT_LIMITS.disk_mib else f"{limits.disk_mib}m"
    nproc = "-" if limits.pids == BOOT_LIMITS.pids else str(limits.pids)
    writer.write(f"{size} {nproc}\n".encode())
    await writer.drain()
    try:
        line = await reader.readline()
    except (ValueError, asyncio.LimitOverrunError) as exc:
        raise errors.SandboxError("microVM stage 2 sent an oversized reply") from exc
    except OSError as exc:
        raise errors.SandboxError(f"microVM control channel failed: {exc}") from exc
    if line != b"ok\n":
        raise errors.SandboxError(
            f"microVM stage 2 did not apply the limits: {line[:200].decode(errors='replace')!r}"
        )
    writer.close()


def _read_verdict(path: Path, key: str) -> tuple[str | None] | None:
    """(reason,) from a fresh-enough probe verdict for ``key``, else None."""
    try:
        saved = json.loads(path.read_text())
        if saved["key"] == key and time.time() - float(saved["at"]) < PROBE_TTL_S:
            reason = saved["reason"]
            return (reason if isinstance(reason, str) else None,)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_verdict(path: Path, key: str, reason: str | None) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "reason": reason, "at": time.time()}))
        tmp.replace(path)
    except OSError:
        return  # a read-only cache only costs a re-probe next time


def _load_snapshot(snap_dir: Path, argv: list[str]) -> Snapshot | None:
    try:
        meta = SnapshotMeta.model_validate_json((snap_dir / "meta.json").read_text())
        saved_argv = json.loads((snap_dir / "argv.json").read_text())
    except (OSError, ValueError):
        return None
    state = snap_dir / "state.bin"
    if saved_argv != argv or not state.is_file():
        return None
    return Snapshot(state=state, argv=argv, meta=meta)


class _FileLock:
    """An exclusive flock taken in a thread, so other coroutines run while a build waits."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    async def __aenter__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        await asyncio.to_thread(fcntl.flock, self._fd, fcntl.LOCK_EX)

    async def __aexit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
