"""Agent start on the agent runtime against the image's own python, beside the bare runtime's
floor, in the same sitting (prints; asserts nothing).

    .venv/bin/python bench/agent_runtime.py [--levels gvisor,namespaces] [--n 10]

Per level, ``--n`` rounds; each round starts one sandbox of every variant in turn (alternated,
so the load's drift touches all alike), measures its boot (spawn until the agent's hello,
``ProcessSandbox.boot_ms``), runs ``true`` in it and destroys it:

- ``image python``: the agent as before the runtime, the ``default`` image's ``/usr/bin/python3``
  running ``/opt/ephemeral/agent.pyc`` (the runtime is mounted but unused);
- ``runtime``: what the drivers do, the agent runtime's loader and python at ``/.ephemeral``;
- ``runtime, mounts shared`` (gvisor): the same without ``--file-access-mounts=exclusive``, so
  the Sentry revalidates every runtime file with the Gofer (runsc's default for a bind mount);
- ``runtime, busybox image``: the same on an image of Debian's static busybox alone;
- ``static hello (no python)``: the drivers' path with the agent replaced by a static C program
  that writes a hello frame and waits (no interpreter; boot only, it answers nothing): what
  the sandbox costs without Python, so the rest of ``runtime`` is the interpreter and the agent;
- floor: a bare ``runsc do true`` (gvisor) or ``bwrap ... true`` (namespaces), one per round,
  until it exits (its teardown included); and (gvisor) ``runsc do`` of the static hello until
  its first byte on stdout, the bare start that compares with a sandbox's spawn-to-hello;
- (gvisor) the interpreter alone under a bare ``runsc do``: the host's Debian
  ``/usr/bin/python3 -I -S -c pass`` (the same build as the image's) and the runtime's, through
  its own loader, from its host directory.

Then p50 / p90 / min / max of each and each p50's ratio to the floor's p50, and the issue's
figure (issue 36: gVisor cold start <= 1.1x bare ``runsc``): the ``runtime`` boot's p50 and p90
over the floor's, and the same for ``runtime: first reply`` (spawn until the reply to the first
``exec true``: the hello plus the first request's round trip, what a caller waits for).
``--variants runtime`` measures only the drivers' own path (and the floors).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.measure import floor_table, pct, timed_proc
from ephemeral.sandbox import agent_runtime, images, registry
from ephemeral.sandbox.base import Limits
from ephemeral.sandbox.gvisor import GVisorDriver
from ephemeral.sandbox.process import ProcessDriver
from ephemeral.settings import Settings
from tests.sandbox.conftest import busybox_tree

IMAGE_PYTHON = ["/usr/bin/python3", "-I", "-S", "/opt/ephemeral/agent.pyc"]
PASS = ["-I", "-S", "-c", "pass"]
EXCLUSIVE = "--file-access-mounts=exclusive"


FIRST_BYTE = "bare runsc do: first byte"


def floors(level: str, rootfs: Path, state: str, runtime: Path, stub: Path) -> dict[str, list[str]]:
    """The bare commands measured beside the sandboxes, by name."""
    if level == "gvisor":
        runsc = ["runsc", f"--root={state}", "--network=none", "--platform=ptrace", "do"]
        ours = [
            str(runtime / "lib" / agent_runtime.LOADER), "--inhibit-cache",
            "--library-path", str(runtime / "lib"), str(runtime / "bin" / "python3"),
        ]  # fmt: skip
        return {
            "floor": [*runsc, "true"],
            FIRST_BYTE: [*runsc, str(stub / "hello")],
            "runsc do image python -c pass": [*runsc, "/usr/bin/python3", *PASS],
            "runsc do runtime python -c pass": [*runsc, *ours, *PASS],
        }
    bwrap = [
        "bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", str(rootfs), "/",
        "--proc", "/proc", "--dev", "/dev", "/bin/true",
    ]  # fmt: skip
    return {"floor": bwrap}


STUB = """#include <string.h>
#include <unistd.h>
int main(void) {
    const char *j = "{\\"type\\":\\"hello\\",\\"protocol\\":2,\\"pid\\":1,\\"uid\\":0,"
                    "\\"workdir\\":\\"/tmp/ephemeral-run-stub/scratch\\"}";
    unsigned n = strlen(j);
    unsigned char h[4] = {n >> 24, n >> 16, n >> 8, n};
    char buf[4096];
    if (write(1, h, 4) != 4 || write(1, j, n) != (ssize_t)n) return 1;
    while (read(0, buf, sizeof buf) > 0) {}
    return 0;
}
"""
STUBBED = "static hello (no python)"


def build_stub(directory: Path) -> Path:
    """``directory`` with ``hello`` in it: the static stand-in for the agent."""
    (directory / "hello.c").write_text(STUB)
    subprocess.run(
        ["gcc", "-O2", "-static", "-o", str(directory / "hello"), str(directory / "hello.c")],
        check=True,
    )
    (directory / "hello.c").unlink()
    return directory


async def boot_once(
    settings: Settings, level: str, variant: str, stub: Path
) -> tuple[float, float | None]:
    """(boot, first reply) in ms: spawn until the hello, and create until ``true``'s reply
    (None for the stub, which answers nothing)."""
    driver = registry.get_driver(level, settings)
    assert isinstance(driver, ProcessDriver)
    if variant == STUBBED:
        driver._agent_argv = lambda: (stub, [f"{agent_runtime.MOUNT}/hello"])  # type: ignore[method-assign]
    if variant == "image python":
        await driver._image()
        runtime = driver._runtime
        assert runtime is not None
        driver._agent_argv = lambda: (runtime.root, IMAGE_PYTHON)  # type: ignore[method-assign]
    if variant == "runtime, mounts shared":
        argv = GVisorDriver.runsc_argv
        driver.runsc_argv = lambda *a: [x for x in argv(*a) if x != EXCLUSIVE]  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    sbx = await driver.create(owner="bench", limits=Limits())
    try:
        if variant == STUBBED:
            return float(sbx.boot_ms), None
        res = await sbx.exec("true")
        first = (time.perf_counter() - t0) * 1000
        if res.exit_code != 0:
            raise SystemExit(f"{level} {variant}: true exited {res.exit_code}: {res.stderr}")
        return float(sbx.boot_ms), first
    finally:
        await sbx.destroy()


async def level_bench(settings: Settings, busybox: str, level: str, n: int, only: set[str]) -> None:
    rootfs = await images.ensure_image(settings)
    variants = {"image python": settings, "runtime": settings}
    if level == "gvisor":
        variants["runtime, mounts shared"] = settings
    variants["runtime, busybox image"] = settings.model_copy(update={"image": busybox})
    variants[STUBBED] = settings
    variants = {k: v for k, v in variants.items() if not only or k in only}
    runtime = await agent_runtime.ensure_runtime(settings)
    with (
        tempfile.TemporaryDirectory(prefix="bench-runsc-") as state,
        tempfile.TemporaryDirectory(prefix="bench-stub-") as stubdir,
    ):
        os.chmod(stubdir, 0o755)
        stub = build_stub(Path(stubdir))
        bare = floors(level, rootfs, state, runtime.root, stub)
        times: dict[str, list[float]] = {v: [] for v in [*variants, *bare]}
        if "runtime" in variants:
            times["runtime: first reply"] = []
        for name, s in variants.items():  # warm: the runtime's build, the image checks
            await boot_once(s, level, name, stub)
        for _ in range(n):
            for name, s in variants.items():
                boot, first = await boot_once(s, level, name, stub)
                times[name].append(boot)
                if name == "runtime" and first is not None:
                    times["runtime: first reply"].append(first)
            for name, argv in bare.items():
                times[name].append(await timed_proc(argv, first_byte=name == FIRST_BYTE))
    floor_table(
        f"{level} (n={n}, ms; a sandbox's: spawn to the agent's hello)", times, 90, width=32
    )
    bares = {"floor": "bare runsc do true" if level == "gvisor" else "bare bwrap true"}
    if FIRST_BYTE in times:
        bares[FIRST_BYTE] = FIRST_BYTE
    for name in ("runtime", "runtime: first reply"):
        for bare_key, bare_name in bares.items():
            if name not in times:
                continue
            xs, fl = times[name], times[bare_key]
            a, b = statistics.median(xs), statistics.median(fl)
            c, d = pct(xs, 90), pct(fl, 90)
            print(
                f"  {level} cold start, {name} / {bare_name}: p50 {a:.1f} / {b:.1f} = "
                f"{a / b:.2f}x, p90 {c:.1f} / {d:.1f} = {c / d:.2f}x"
            )


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="gvisor,namespaces")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--variants", default="", help="comma-separated subset (default: all)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-agent-runtime-") as tmp:
        settings = Settings.load(state_dir=Path(tmp) / "state", use_prefect=False)
        busybox_tree(Path(tmp) / "busybox")
        busybox = "bench-busybox"
        images.register_rootfs(settings, busybox, Path(tmp) / "busybox", digest=f"bench:{tmp}")
        try:
            for level in args.levels.split(","):
                only = {v for v in args.variants.split(",") if v}
                await level_bench(settings, busybox, level, args.n, only)
        finally:
            images.remove_images(settings, busybox)


if __name__ == "__main__":
    asyncio.run(main())
