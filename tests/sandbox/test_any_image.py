"""Images we did not build host sandboxes: a lone static busybox (no libc, no Python, no /tmp)
and a Debian minbase without Python. Our side of the sandbox (the agent, its statx shim, its
egress forwarder) runs on the agent runtime mounted read-only at /.ephemeral, never on the
image's files, and nothing inside can change that runtime.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.sandbox import agent_runtime, images
from ephemeral.sandbox.base import Limits, Sandbox, SandboxDriver
from ephemeral.sandbox.streams import GuestStream
from ephemeral.settings import Settings
from tests.drivers import unavailable
from tests.patience import PATIENCE
from tests.sandbox.conftest import Factory, busybox_tree, driver_for

pytestmark = pytest.mark.sandbox

AGENT = Path(__file__).resolve().parents[2] / "sandbox_images" / "default" / "guest" / "agent.py"
CASES = [
    pytest.param((iso, image), id=f"{iso}-{image.removesuffix('_image')}")
    for image in ("busybox_image", "no_python_image")
    for iso in ("namespaces", "gvisor")
]


@pytest.fixture(params=CASES)
def driver(request: pytest.FixtureRequest, sandbox_settings: Settings) -> SandboxDriver:
    iso, image = request.param
    return driver_for(iso, sandbox_settings, request.getfixturevalue(image))


async def test_a_session_runs_in_an_image_without_python(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    res = await sbx.exec("sh -c 'echo hi; id'")
    assert (res.exit_code, res.stderr) == (0, "")
    # busybox's id leaves out the empty supplementary groups that Debian's shows as the primary
    assert res.stdout.startswith("hi\nuid=1000(worker) gid=1000(worker)"), res.stdout
    assert (await sbx.exec("command -v python3 || ls /usr/bin/python3*")).exit_code != 0
    assert (await sbx.exec(["id", "-u"], user="root")).stdout == "0\n"
    assert (await sbx.exec(["sh", "-c", "echo err >&2; exit 3"])).exit_code == 3
    assert (await sbx.exec(["no-such-command"])).exit_code == 127
    blob = os.urandom(200_000)
    await sbx.put_file("data/blob.bin", blob)
    assert await sbx.get_file("data/blob.bin") == blob
    await sbx.put_file("run.sh", b"#!/bin/sh\necho ran $1\n", mode=0o755)
    assert (await sbx.exec(["./run.sh", "x"])).stdout == "ran x\n"
    late = await sbx.exec("sleep 100", timeout=1.0)
    assert late.timed_out and late.exit_code == 137
    assert (await sbx.exec("sleep 300 </dev/null >/dev/null 2>&1 &")).exit_code == 0
    assert await sbx.kill_all() >= 1  # type: ignore[attr-defined]
    assert (await sbx.exec("ps -eo comm= | grep -c '^sleep$'")).stdout.strip() == "0"
    assert (await sbx.exec("echo alive")).stdout == "alive\n"


async def test_every_module_the_agent_imports_is_in_the_runtime(make_sandbox: Factory) -> None:
    """Imported inside the sandbox from the runtime alone (the image has no Python): a lazy
    import (the egress forwarder's socket and threading, reseed's struct) cannot fail later."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(AGENT.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    assert {"socket", "threading", "ctypes", "resource", agent_runtime.NATIVE} <= names
    names.discard(agent_runtime.NATIVE)  # optional (built where the host can): the test below
    sbx = await make_sandbox()
    python = shlex.join(agent_runtime.AgentRuntime(Path("/"), "-").argv()[:-1])
    res = await sbx.exec(f"{python} -c 'import {', '.join(sorted(names))}; print(\"ok\")'")
    assert (res.exit_code, res.stdout) == (0, "ok\n"), res.stderr


async def test_the_agent_starts_on_the_runtimes_own_system_calls(
    make_sandbox: Factory, sandbox_settings: Settings
) -> None:
    """The runtime's ``_ephemeral_agent`` (agent_sys.c) stands in for ctypes and resource at the
    agent's start (~25 ms of a gVisor cold start), and its calls do what theirs did."""
    runtime = await agent_runtime.ensure_runtime(sandbox_settings)
    if not list(runtime.root.glob(f"lib/python3.*/lib-dynload/{agent_runtime.NATIVE}.*.so")):
        pytest.skip("no Python.h of the runtime's python on this host: the agent uses ctypes")
    sbx = await make_sandbox(memory_mib=300)
    # a second agent, as a worker's command: its hello on stdout, then stdin's EOF ends it
    *python, script = runtime.argv()
    argv = [*python, "-X", "importtime", script, "--max-memory-mib", "64"]
    res = await sbx.exec(f"{shlex.join(argv)} </dev/null")
    assert res.exit_code == 0 and '"type":"hello"' in res.stdout, res.stderr
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in res.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert agent_runtime.NATIVE in imported, res.stderr
    assert not imported & {"ctypes", "_ctypes", "resource"}, res.stderr
    # the sandbox's own agent through it: commands lose every capability as the worker, and
    # get the address-space cap under gVisor (the namespaces driver sets none)
    caps = await sbx.exec("grep -E '^Cap(Inh|Prm|Eff)' /proc/self/status")
    assert [line.split()[1] for line in caps.stdout.splitlines()] == ["0" * 16] * 3
    if sbx.isolation == "gvisor":
        assert (await sbx.exec("ulimit -v")).stdout == f"{300 * 1024}\n"


async def _egress_round_trip(sbx: Sandbox) -> None:
    """A connection to the egress forwarder's port inside comes out here and is answered."""

    async def answer(stream: GuestStream) -> None:
        got = await stream.read()
        await stream.write(b"pong:" + got)
        await stream.close()

    await sbx.start_egress(answer, port=3128, max_streams=4, window=1 << 16)  # type: ignore[attr-defined]
    talk = (
        "if command -v nc >/dev/null; then echo ping | nc 127.0.0.1 3128; else "
        "bash -c 'exec 3<>/dev/tcp/127.0.0.1/3128; echo ping >&3; cat <&3'; fi"
    )
    res = await sbx.exec(talk, timeout=PATIENCE)
    assert res.stdout == "pong:ping\n", res.stderr


async def test_the_egress_forwarder_runs_in_an_image_without_python(make_sandbox: Factory) -> None:
    await _egress_round_trip(await make_sandbox())


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        h.update(f"{p.relative_to(root)} {st.st_mode:o} {st.st_uid} {st.st_size}\n".encode())
        if p.is_file() and not p.is_symlink():
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


ATTEMPTS = [
    "touch /.ephemeral/planted",
    "rm -f /.ephemeral/agent.pyc",
    "mv /.ephemeral/agent.pyc /tmp/",
    "chmod 777 /.ephemeral/bin/python3",
    "echo 'import os' >> /.ephemeral/lib/python3.11/socket.py",
    "ln -s /tmp /.ephemeral/lib/planted",
    "mount -o remount,rw /.ephemeral",
    "umount /.ephemeral",
    "umount -l /.ephemeral",
    "mount -t tmpfs none /.ephemeral",
    "mount -t tmpfs none /.ephemeral/lib",
]


async def test_root_inside_cannot_change_the_runtime(
    make_sandbox: Factory, sandbox_settings: Settings
) -> None:
    runtime = await agent_runtime.ensure_runtime(sandbox_settings)
    before = await asyncio.to_thread(_tree_digest, runtime.root)
    sbx = await make_sandbox()
    for attempt in ATTEMPTS:
        for user in ("root", None):
            res = await sbx.exec(attempt, user=user)
            assert res.exit_code != 0, (attempt, user, res.stdout)
    listing = await sbx.exec("ls -a /.ephemeral /.ephemeral/lib")
    assert "planted" not in listing.stdout and "agent.pyc" in listing.stdout
    assert await asyncio.to_thread(_tree_digest, runtime.root) == before
    # the agent still imports from it, after all that
    await _egress_round_trip(sbx)


async def test_the_statx_shim_goes_only_to_glibc_images_under_gvisor(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    listed = await sbx.exec("cat /etc/ld.so.preload")
    glibc = (await sbx.exec("test -e /lib64/ld-linux-x86-64.so.2")).exit_code == 0
    if sbx.isolation == "gvisor" and glibc:
        assert listed.stdout == f"{agent_runtime.SHIM}\n"
        # coreutils' statx flags, which this runsc refuses without the shim
        assert (await sbx.exec("ls -l /etc/hostname && stat -c %s /etc/passwd")).exit_code == 0
    else:
        assert listed.exit_code != 0, listed.stdout  # no shim where nothing would load it


EVIL = "#include <unistd.h>\n__attribute__((constructor)) static void evil(void) { _exit(66); }\n"


@pytest.fixture(scope="session")
def hostile_image(sandbox_settings: Settings, rootfs: Path) -> Iterator[str]:
    """Busybox plus every file through which glibc or CPython would take the image's code into
    the agent: an ld.so.preload library that kills its process, a standard library at each
    place python's path search looks, a ._pth, locale and time zone files, and a file where
    the runtime is mounted."""
    if shutil.which("gcc") is None:
        unavailable("gcc missing (make setup)")
    tree = Path(tempfile.mkdtemp(prefix="ephemeral-hostile-")) / "rootfs"
    busybox_tree(tree)
    src = tree.parent / "evil.c"
    src.write_text(EVIL)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tree / "evil.so"), str(src)], check=True)
    (tree / "etc" / "ld.so.preload").write_text("/evil.so\n")
    poison = "import os\nos._exit(67)\n"
    for d in ("lib/python3.11", "usr/lib/python3.11", ".ephemeral/lib/python3.11", "bin/lib"):
        (tree / d / "encodings").mkdir(parents=True)
        for f in ("os.py", "encodings/__init__.py", "socket.py", "threading.py"):
            (tree / d / f).write_text(poison)
    for f in ("lib/python311.zip", "._pth", ".ephemeral/agent.pyc", "etc/localtime"):
        (tree / f).write_bytes(b"garbage\n")
    (tree / "usr" / "lib" / "locale" / "C.utf8").mkdir(parents=True)
    (tree / "usr" / "lib" / "locale" / "C.utf8" / "LC_CTYPE").write_bytes(b"\xff" * 64)
    name = f"test-hostile-{os.getpid()}"
    images.register_rootfs(sandbox_settings, name, tree, digest=f"test:{tree}")
    yield name
    images.remove_images(sandbox_settings, name)
    shutil.rmtree(tree.parent, ignore_errors=True)


@pytest.mark.parametrize("iso", ["namespaces", "gvisor"])
async def test_nothing_of_the_image_runs_in_the_agent(
    iso: str, sandbox_settings: Settings, hostile_image: str
) -> None:
    driver = driver_for(iso, sandbox_settings, hostile_image)
    sbx = await driver.create(owner="test", limits=Limits())
    try:
        assert (await sbx.exec("echo ok")).stdout == "ok\n"
        # the egress forwarder's lazy imports come from the runtime too
        await _egress_round_trip(sbx)
    finally:
        await sbx.destroy()


async def test_a_registered_tree_is_an_image_until_removed(tmp_path: Path) -> None:
    settings = Settings.load(
        state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", use_prefect=False
    )
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    found = images.register_rootfs(
        settings, "mine", tree, digest="sha256:" + "0" * 64, env={"A": "1"}, user="root", cwd="/w"
    )
    assert found.rootfs.resolve() == tree.resolve()
    assert (found.hash, found.env, found.user, found.cwd) == (
        "sha256:" + "0" * 64,
        {"A": "1"},
        "root",
        "/w",
    )
    assert await images.ensure_image(settings, "mine") == found.rootfs
    assert images.available(settings) == ["mine"]
    removed = images.remove_images(settings, "mine")
    assert removed and removed[0].name.startswith("mine-")
    assert images.built_image(settings, "mine") is None
    assert (tree / "etc" / "passwd").is_file()  # the tree is never ours to remove
    with pytest.raises(errors.InvalidRequest) as bad:
        images.register_rootfs(settings, "Not A Name", tree, digest="x")
    assert bad.value.errors[0]["field"] == "name"
    with pytest.raises(errors.InvalidRequest) as bad:
        images.register_rootfs(settings, "mine", tree / "etc" / "passwd", digest="x")
    assert bad.value.errors[0]["field"] == "rootfs"
