"""The agent runtime: what runs our side of a ``namespaces`` or ``gvisor`` sandbox, whatever the
image holds (Debian, Ubuntu, a musl Alpine, a lone static busybox, no Python at all).

One directory per content, built once on the host under ``<image cache>/runtime/<hash16>/``
and mounted read-only at :data:`MOUNT` in every sandbox (``writable_root.py`` mounts it, the
drivers map it)::

    bin/python3                  CPython, copied from the ``default`` image (Debian's build)
    lib/ld-linux-x86-64.so.2     glibc's loader from the same image, reading no /etc/ld.so.preload
    lib/lib*.so.*                every library python3 and its extension modules need
    lib/python3.X/               the standard library (no tests, IDLE, Tk, site-packages)
    lib/statx_shim.so            gVisor's statx workaround (statx_shim.c), for the image's programs
    lib/python3.X/lib-dynload/_ephemeral_agent.*.so
                                 the agent's prctl, capset and rlimit calls (agent_sys.c), built
                                 where the host has Python.h of the same python version
    agent.py, agent.pyc          the guest agent (the ``default`` definition's agent source)

The agent is started as ``/.ephemeral/lib/ld-linux-x86-64.so.2 --inhibit-cache --library-path
/.ephemeral/lib /.ephemeral/bin/python3 -I -S -X utf8 /.ephemeral/agent.pyc``: the kernel maps
our loader (the image's ELF interpreter is never used), which loads only our libraries (no
``ld.so.cache``; every ``DT_NEEDED`` is found in ours first), and python finds its standard
library beside its own executable. What else glibc or python would read from the image is
closed too: ``/etc/ld.so.preload``, which glibc's loader reads whatever its options, is renamed
in our copy of the loader to :data:`NO_PRELOAD` (under the read-only mount, never a file), the
agent's locale is ``C`` (no locale files; python runs in its UTF-8 mode) and its time zone a
rule (``TZ=UTC0`` with ``TZDIR`` under the mount: no zone file). The agent then reads only
``/etc/passwd`` of the image (``lookup_user``, bounded), and runs the image's programs.

Why it cannot be touched from inside: the mount is read-only (``ro`` bind in bwrap and in the
OCI spec), of a read-only overlayfs (no upper layer), whose files belong to host root (in a
``namespaces`` sandbox an unmapped uid, so not even the sandbox's root has DAC rights over them)
and the sandbox's processes hold no ``CAP_SYS_ADMIN`` to remount or unmount it. The host copy is
root's, built atomically (a directory renamed into place) and never written again.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import py_compile
import shutil
import struct
import subprocess
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ephemeral import errors
from ephemeral.sandbox import images
from ephemeral.settings import Settings

MOUNT = "/.ephemeral"  # where every sandbox sees the runtime
LOADER = "ld-linux-x86-64.so.2"
NO_PRELOAD = f"{MOUNT}/-"  # our loader's /etc/ld.so.preload: a path that never exists
SOURCE_IMAGE = "default"  # the image whose python3 and libraries the runtime is made of
SHIM_SOURCE = Path(__file__).with_name("statx_shim.c")
SHIM = f"{MOUNT}/lib/statx_shim.so"
NATIVE_SOURCE = Path(__file__).with_name("agent_sys.c")
NATIVE = "_ephemeral_agent"  # its module name
# Bumped when the layout or the build changes for the same inputs (it is part of the hash).
RUNTIME_VERSION = 2
# The agent's own environment (its commands get theirs from the agent, never this).
ENV = {"LC_ALL": "C", "TZ": "UTC0", "TZDIR": NO_PRELOAD, "PATH": "/usr/local/bin:/usr/bin:/bin"}

_LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib")
# Not imported by the agent, and large or code the agent must never reach
_STDLIB_SKIP = frozenset(
    {
        "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
        "site-packages", "dist-packages", "venv", "__phello__", "sitecustomize.py",
    }
)  # fmt: skip
_DYNLOAD_SKIP = ("_test", "xx", "_ctypes_test", "_tkinter")
# unwinding (pthread_cancel, a C++ exception) dlopens it by name: found in ours, never the image's
_ALSO = ("libgcc_s.so.1",)
_GCC = ("gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror")
log = logging.getLogger(__name__)
_built: dict[Path, AgentRuntime] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class AgentRuntime:
    """A built runtime: ``root`` on the host, mounted at :data:`MOUNT` inside."""

    root: Path
    agent: str  # the agent's path inside the sandbox (compiled when the host could)

    def argv(self, agent: str | None = None) -> list[str]:
        """The agent's command line inside the sandbox (``agent``: another script, for tests)."""
        return [
            f"{MOUNT}/lib/{LOADER}",
            "--inhibit-cache",
            "--library-path",
            f"{MOUNT}/lib",
            f"{MOUNT}/bin/python3",
            "-I",
            "-S",
            "-X",
            "utf8",
            agent or self.agent,
        ]


async def ensure_runtime(settings: Settings) -> AgentRuntime:
    """The runtime for this host's ``default`` image, built on first use (about 3 s)."""
    rootfs = await images.ensure_image(settings, SOURCE_IMAGE)
    defdir = images.definition_dir(settings, SOURCE_IMAGE)
    definition = images.load_definition(defdir)
    assert definition.agent is not None  # a root image declares its agent
    agent = images.source_path(defdir, definition.agent.source)
    return await asyncio.to_thread(_ensure, settings.image_cache_dir, rootfs, agent)


def _key(rootfs: Path, agent: Path) -> str:
    # the source image's directory is named by its definition's hash: its python is fixed by it
    h = hashlib.sha256(f"runtime-{RUNTIME_VERSION}\n{rootfs.parent.name}\n".encode())
    for part in (agent.read_bytes(), SHIM_SOURCE.read_bytes(), NATIVE_SOURCE.read_bytes()):
        h.update(len(part).to_bytes(8, "big") + part)
    return h.hexdigest()


def _ensure(cache: Path, rootfs: Path, agent: Path) -> AgentRuntime:
    out = cache / "runtime" / _key(rootfs, agent)[:16]
    with _lock:
        found = _built.get(out)
        if found is not None:
            return found
        if not (out / "runtime.json").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(out.parent / f".{out.name}.lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # another process may be building it
                if not (out / "runtime.json").is_file():
                    _build(rootfs, agent, out)
            finally:
                os.close(fd)
        meta = json.loads((out / "runtime.json").read_text())
        found = AgentRuntime(root=out, agent=f"{MOUNT}/{meta['agent']}")
        _built[out] = found
        return found


def _build(rootfs: Path, agent: Path, out: Path) -> None:
    if shutil.which("gcc") is None:
        raise errors.SandboxError("agent runtime: its statx shim needs gcc (apt-get install gcc)")
    t0 = time.monotonic()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / "bin").mkdir(parents=True)
        lib = tmp / "lib"
        lib.mkdir()
        version = images.image_python(rootfs)
        python = _in_root(rootfs, f"usr/bin/python{version}")
        shutil.copy2(python, tmp / "bin" / "python3")
        stdlib = lib / f"python{version}"
        shutil.copytree(_in_root(rootfs, f"usr/lib/python{version}"), stdlib, ignore=_skip)
        dynload = stdlib / "lib-dynload"
        wanted = [tmp / "bin" / "python3", *sorted(dynload.glob("*.so"))]
        for name in sorted(_closure(rootfs, wanted, dynload) | set(_ALSO)):
            shutil.copy2(_library(rootfs, name), lib / name)
        (lib / LOADER).write_bytes(_loader(rootfs))
        (lib / LOADER).chmod(0o755)
        shutil.copy2(agent, tmp / "agent.py")
        entry = _compile(tmp / "agent.py", stdlib)
        subprocess.run(
            [*_GCC, "-o", str(lib / "statx_shim.so"), str(SHIM_SOURCE)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        _native(dynload, version)
        for p in [tmp, *tmp.rglob("*")]:
            if not p.is_symlink():
                p.chmod(p.stat().st_mode & ~0o022)  # nobody but host root writes it
        meta = {"python": version, "source": rootfs.parent.name, "agent": entry}
        (tmp / "runtime.json").write_text(json.dumps(meta))
        os.rename(tmp, out)
    except FileNotFoundError as exc:
        raise errors.SandboxError(f"agent runtime: {exc}") from exc
    except subprocess.CalledProcessError as exc:
        why = exc.stderr.decode(errors="replace")[-2000:]
        raise errors.SandboxError(f"agent runtime: {exc.cmd[-1]}: {why}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("agent runtime %s built in %.1f s", out.name, time.monotonic() - t0)


def _native(dynload: Path, version: str) -> None:
    """:data:`NATIVE` into ``dynload``, compiled against the host's Python.h when the host's
    python is the runtime's version (the limited API of that version): the agent then starts
    without ctypes and resource, ~25 ms of a gVisor cold start. Without the headers the agent
    imports those instead, as on an image's python."""
    include = Path(sysconfig.get_paths()["include"])
    if sysconfig.get_python_version() != version or not (include / "Python.h").is_file():
        log.info("agent runtime: no Python.h for python %s here; the agent uses ctypes", version)
        return
    sample = next(dynload.glob("_json.*.so"), None)  # the runtime's extension suffix
    if sample is None:
        return
    suffix = sample.name.removeprefix("_json")
    major, minor = (int(x) for x in version.split("."))
    subprocess.run(
        [
            *_GCC, f"-DPy_LIMITED_API=0x{major:02x}{minor:02x}0000", f"-I{include}",
            "-o", str(dynload / f"{NATIVE}{suffix}"), str(NATIVE_SOURCE),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )  # fmt: skip


def _skip(directory: str, names: list[str]) -> set[str]:
    """copytree's filter: what the agent never needs, and every symlink (a link could name a
    path of the host, or of the image once mounted)."""
    skip = {n for n in names if n in _STDLIB_SKIP or os.path.islink(os.path.join(directory, n))}
    if os.path.basename(directory) == "lib-dynload":
        skip |= {n for n in names if n.startswith(_DYNLOAD_SKIP)}
    if os.path.basename(directory).startswith("config-"):
        skip |= set(names)
    return skip


def _in_root(rootfs: Path, rel: str) -> Path:
    """``rootfs/rel``, a regular file or directory reached without symlinks: the image's links
    are never followed on the host (an absolute one would name a host path)."""
    p = rootfs
    for part in rel.split("/"):
        p = p / part
        if p.is_symlink():
            raise errors.SandboxError(f"agent runtime: {p} is a symlink in image {SOURCE_IMAGE}")
    if not p.exists():
        raise errors.SandboxError(f"agent runtime: image {SOURCE_IMAGE} has no /{rel}")
    return p


def _library(rootfs: Path, name: str) -> Path:
    """A library of the image by its soname: a file of one of its library directories, or a
    symlink there to a file beside it (Debian's ``libz.so.1 -> libz.so.1.2.13``)."""
    for d in _LIB_DIRS:
        p = rootfs / d / name
        for _ in range(8):
            if not p.is_symlink():
                break
            target = os.readlink(p)
            if "/" in target:
                raise errors.SandboxError(f"agent runtime: {p} links out of its directory")
            p = p.with_name(target)
        if p.is_file() and not p.is_symlink():
            return p
    raise errors.SandboxError(f"agent runtime: image {SOURCE_IMAGE} has no library {name}")


def _closure(rootfs: Path, files: list[Path], dynload: Path) -> set[str]:
    """The sonames ``files`` need, transitively (the loader aside). An extension module whose
    libraries the image lacks is dropped: the agent imports none of those (a test checks)."""
    found: dict[str, Path | None] = {}  # soname -> its file in the image, None when absent
    deps: dict[Path, list[str]] = {}

    def needed(path: Path) -> list[str]:
        if path not in deps:
            deps[path] = _needed(path)
        return deps[path]

    out: set[str] = set()
    for f in files:
        need: set[str] = set()
        todo = list(needed(f))
        while todo:
            name = todo.pop()
            if name in need or name == LOADER:
                continue
            if name not in found:
                try:
                    found[name] = _library(rootfs, name)
                except errors.SandboxError:
                    found[name] = None
            path = found[name]
            if path is None:
                break
            need.add(name)
            todo += needed(path)
        else:
            out |= need
            continue
        if f.parent != dynload:
            raise errors.SandboxError(f"agent runtime: {f.name} needs {name}, not in the image")
        log.info("agent runtime: %s dropped (the image has no %s)", f.name, name)
        f.unlink()
    return out


def _elf(path: Path) -> tuple[bytes, list[tuple[int, int, int, int, int]]]:
    """An x86-64 ELF file's bytes and program headers (type, offset, vaddr, filesz)."""
    data = path.read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        raise errors.SandboxError(f"agent runtime: {path} is not a 64-bit little-endian ELF")
    (phoff,) = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    headers = []
    for i in range(phnum):
        kind, _flags, offset, vaddr, _paddr, filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize
        )
        headers.append((kind, offset, vaddr, filesz, i))
    return data, headers


def static(path: Path) -> bool:
    """Whether an ELF program runs without a loader (no ``PT_INTERP``): it needs no libc."""
    return all(kind != 3 for kind, *_ in _elf(path)[1])


def _needed(path: Path) -> list[str]:
    """The ``DT_NEEDED`` sonames of an x86-64 ELF file (its dynamic section, read directly)."""
    data, headers = _elf(path)
    loads = [(vaddr, offset, size) for kind, offset, vaddr, size, _ in headers if kind == 1]
    dynamic = next(((o, size) for kind, o, _v, size, _ in headers if kind == 2), None)
    if dynamic is None:
        return []
    entries: list[tuple[int, int]] = []
    for at in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, value = struct.unpack_from("<qQ", data, at)
        if tag == 0:  # DT_NULL
            break
        entries.append((tag, value))
    strtab = next(v for t, v in entries if t == 5)  # DT_STRTAB, an address
    base = next(o + strtab - va for va, o, size in loads if va <= strtab < va + size)
    return [data[base + v : data.index(b"\0", base + v)].decode() for t, v in entries if t == 1]


def _loader(rootfs: Path) -> bytes:
    """The image's glibc loader with its ``/etc/ld.so.preload`` renamed to :data:`NO_PRELOAD`:
    glibc reads that file in every process it starts and has no option to skip it, and an
    image's file there would put the image's code into the agent."""
    data = _library(rootfs, LOADER).read_bytes()
    old = b"/etc/ld.so.preload\0"
    new = NO_PRELOAD.encode().ljust(len(old), b"\0")
    if data.count(old) != 1 or len(new) != len(old):
        raise errors.SandboxError(
            f"agent runtime: image {SOURCE_IMAGE}'s {LOADER} does not name /etc/ld.so.preload once"
        )
    return data.replace(old, new)


def _compile(agent: Path, stdlib: Path) -> str:
    """``agent.pyc`` when the host's python writes this runtime's bytecode (same magic as the
    runtime's own compiled standard library), else ``agent.py``: a script run as ``__main__``
    is otherwise recompiled at every start (~10 ms of a cold start). Nothing of the image runs
    on the host for it."""
    with contextlib.suppress(OSError, StopIteration):
        sample = next((stdlib / "__pycache__").glob("os.*.pyc"))
        if sample.read_bytes()[:4] == importlib.util.MAGIC_NUMBER:
            py_compile.compile(
                str(agent),
                cfile=str(agent.with_suffix(".pyc")),
                doraise=True,
                invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
            )
            return "agent.pyc"
    return "agent.py"
