"""CLI group: sandbox (``sandbox exec|shell|reap``, ``isolation``,
``images build|list|rm|alias|gc``)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from ephemeral import errors
from ephemeral.cli.output import fail
from ephemeral.policy import MIN_DISK_MIB
from ephemeral.sandbox import images, reaper, registry
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.settings import Settings

T = TypeVar("T")

sandbox_app = typer.Typer(no_args_is_help=True, help="Disposable sandboxes, by hand.")
images_app = typer.Typer(no_args_is_help=True, help="Guest images (built with mmdebstrap, cached).")

IsolationOpt = Annotated[
    str | None,
    typer.Option(
        "--isolation",
        "-i",
        help="auto, gvisor, namespaces, microvm, microvm-tcg (default: settings).",
    ),
]


def _run(coro_fn: Callable[[], Awaitable[T]]) -> T:
    try:
        return asyncio.run(_as_coro(coro_fn))
    except errors.EphemeralError as exc:
        raise fail(exc) from exc


async def _as_coro(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()


async def _open(
    settings: Settings, isolation: str | None, owner: str, limits: Limits | None = None
) -> Sandbox:
    await reaper.reap(settings)
    iso = await registry.resolve_isolation(isolation or settings.isolation, settings)
    driver = registry.get_driver(iso, settings)
    return await driver.create(owner=owner, limits=limits or Limits())


def _command(words: list[str]) -> str | list[str]:
    # One word is a shell string (`-- 'ls | wc -l'`); several are an argv, passed verbatim.
    return words[0] if len(words) == 1 else words


@sandbox_app.command("exec")
def exec_cmd(
    command: Annotated[list[str], typer.Argument(help="Command: one shell string, or an argv.")],
    isolation: IsolationOpt = None,
    timeout: Annotated[float, typer.Option(min=0.1, help="Deadline in seconds.")] = 30.0,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Print isolation and timings.")
    ] = False,
    image: Annotated[
        str | None,
        typer.Option(help="A built image (ephemeral images list) or an OCI reference."),
    ] = None,
    disk_mib: Annotated[
        int | None,
        typer.Option(
            "--disk-mib",
            min=MIN_DISK_MIB,
            help="The sandbox's writable root (/ and /tmp) in MiB, up to "
            "EPHEMERAL_DISK_MAX_MIB; default 256.",
        ),
    ] = None,
) -> None:
    """Run one command in a fresh sandbox, print its output and exit with its code."""
    settings = Settings.load()
    limits = Limits() if disk_mib is None else Limits(disk_mib=disk_mib)
    if limits.disk_mib > settings.disk_max_mib:
        raise fail(
            errors.InvalidRequest.field(
                "--disk-mib", f"must be at most {settings.disk_max_mib} (EPHEMERAL_DISK_MAX_MIB)"
            )
        )
    env: dict[str, str] = {}
    if image is not None:
        try:
            from ephemeral.oci import sandbox_image

            if sandbox_image.is_reference(image):  # pulled now if this host lacks it
                env = _run(lambda: sandbox_image.ensure(settings, image, field="--image")).env
            else:
                env = images.require_built(settings, image, field="--image").env
        except errors.EphemeralError as exc:
            raise fail(exc) from exc
        settings = settings.model_copy(update={"image": image})
    stdin = b"" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer.read()

    async def go() -> int:
        t0 = time.monotonic()
        sbx = await _open(settings, isolation, "cli", limits)
        try:
            res = await sbx.exec(_command(command), stdin=stdin, timeout=timeout, env=env or None)
        finally:
            await sbx.destroy()
        sys.stdout.write(res.stdout)
        sys.stdout.flush()
        sys.stderr.write(res.stderr)
        if res.truncated:
            sys.stderr.write("[ephemeral: output truncated]\n")
        if res.timed_out:
            sys.stderr.write(f"[ephemeral: killed after the {timeout:g}s deadline]\n")
        if verbose:
            sys.stderr.write(
                f"[ephemeral: isolation={sbx.isolation} boot={sbx.boot_ms}ms "
                f"exec={res.duration_ms}ms total="
                f"{int((time.monotonic() - t0) * 1000)}ms]\n"
            )
        return res.exit_code

    code = _run(go)
    raise typer.Exit(code=code if 0 <= code <= 255 else 1)


@sandbox_app.command("shell")
def shell_cmd(isolation: IsolationOpt = None) -> None:
    """An interactive look inside one sandbox: each line runs with `sh -c`; `exit` ends it."""
    settings = Settings.load()

    async def go() -> None:
        sbx = await _open(settings, isolation, "cli")
        typer.echo(
            f"# {sbx.isolation} sandbox {sbx.id} (boot {sbx.boot_ms} ms), "
            f"workdir {sbx.workdir}; `exit` or Ctrl-D to destroy it",
            err=True,
        )
        cwd = sbx.workdir
        try:
            while True:
                try:
                    line = await asyncio.to_thread(input, "worker$ ")
                except EOFError:
                    break
                if line.strip() in ("exit", "logout"):
                    break
                if not line.strip():
                    continue
                # Keep `cd` across lines: run the line, then report where the shell ended up.
                res = await sbx.exec(
                    f"{line}\n__rc=$?; printf '\\0%s' \"$PWD\"; exit $__rc", cwd=cwd, timeout=300
                )
                out, sep, new_cwd = res.stdout.rpartition("\0")
                if sep:
                    cwd = new_cwd or cwd
                else:
                    out = res.stdout
                sys.stdout.write(out)
                sys.stderr.write(res.stderr)
                if res.exit_code:
                    sys.stderr.write(f"[exit {res.exit_code}]\n")
        finally:
            await sbx.destroy()

    _run(go)


@sandbox_app.command("reap")
def reap_cmd() -> None:
    """Destroy sandboxes whose creating process is gone (also run at start-up)."""
    settings = Settings.load()
    destroyed = _run(lambda: reaper.reap(settings))
    for sid in destroyed:
        typer.echo(f"destroyed {sid}")
    for path in reaper.unreadable_handles(settings):
        typer.echo(f"unreadable handle (left alone): {path}", err=True)
    if not destroyed:
        typer.echo("nothing to reap")


def isolation_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable.")] = False,
    fresh: Annotated[bool, typer.Option("--fresh", help="Ignore the cached probes.")] = False,
) -> None:
    """What isolation this host offers (each level probed by starting one) and what auto picks."""
    settings = Settings.load()

    async def go() -> tuple[dict[str, str | None], str | None, str | None]:
        offered = await registry.offered(settings, fresh=fresh)
        try:
            auto = await registry.resolve_isolation("auto", settings)
            return offered, auto, None
        except errors.IsolationUnavailable as exc:
            return offered, None, exc.detail

    offered, auto, why = _run(go)
    from ephemeral.sandbox.probe import level_report

    reports = {k: level_report(k, v, settings) for k, v in offered.items()}
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "levels": [{"isolation": k, **report} for k, report in reports.items()],
                    "auto": auto,
                    "auto_error": why,
                },
                indent=2,
            )
        )
        return
    for iso, reason in offered.items():
        mark = "yes" if reason is None else "no "
        note = "" if reason is None else f"  ({reason})"
        if iso == "microvm-tcg" and reason is None:
            note = "  (only when asked for: emulation is not a security boundary)"
        if reports[iso]["privileged"]:
            note += "  (PRIVILEGED: agent is host root, runs say namespaces-privileged)"
        typer.echo(f"{mark} {iso:<12} [{reports[iso]['runtime']}]{note}")
    typer.echo(f"auto -> {auto}" if auto else f"auto -> nothing: {why}")


@images_app.command("build")
def images_build(
    name: Annotated[
        str | None, typer.Argument(help="The image (a folder of sandbox_images/).")
    ] = None,
    dockerfile: Annotated[
        Path | None,
        typer.Option("--dockerfile", help="Build this Dockerfile instead (docs/images.md)."),
    ] = None,
    context: Annotated[
        Path | None,
        typer.Option("--context", help="The Dockerfile's build context (default: its folder)."),
    ] = None,
    image_name: Annotated[
        str | None,
        typer.Option("--name", help="The built Dockerfile image's name (default dockerfile-HASH)."),
    ] = None,
    build_arg: Annotated[
        list[str] | None,
        typer.Option("--build-arg", help="K=V for an ARG of the Dockerfile (repeatable)."),
    ] = None,
) -> None:
    """Build image NAME, or a Dockerfile (cached by the hash of its inputs: a second build
    takes seconds)."""
    settings = Settings.load()
    t0 = time.monotonic()
    if dockerfile is None:
        if context is not None or image_name is not None or build_arg:
            raise fail(errors.InvalidRequest.field("--dockerfile", "needed by those options"))
        image = name or "default"
        rootfs = _run(lambda: images.ensure_image(settings, image))
        _run(lambda: images.ensure_layer(settings, image))  # what builds on it needs
        typer.echo(f"{rootfs}  ({time.monotonic() - t0:.1f}s)")
        return
    from ephemeral.sandbox import dockerfile as df

    args: dict[str, str] = {}
    for item in build_arg or []:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise fail(errors.InvalidRequest.field("--build-arg", f"{item!r}: expected K=V"))
        args[key] = value
    built = _run(
        lambda: df.abuild_dockerfile(
            dockerfile, context, name=image_name or name, build_args=args, settings=settings
        )
    )
    typer.echo(f"{built.name}  {built.hash[:16]}  {built.rootfs}  ({time.monotonic() - t0:.1f}s)")
    record = images.image_dir(settings, built.name) / "network.json"
    if record.is_file():  # a build with build_allow_hosts: what its RUNs asked for
        requests = json.loads(record.read_text()).get("requests") or []
        refused = sum(1 for r in requests if not r.get("allowed"))
        typer.echo(f"network: {len(requests)} requests, {refused} refused ({record})")


@images_app.command("alias")
def images_alias(
    name: Annotated[str, typer.Argument(help="A docker_image name (such as python:3.12).")],
    image: Annotated[str, typer.Argument(help="One of our images it stands for.")],
) -> None:
    """Make a docker_image NAME (a task's image with no Dockerfile) resolve to IMAGE."""
    from ephemeral.sandbox import dockerfile as df

    settings = Settings.load()
    try:
        df.set_alias(settings, name, image)
    except errors.EphemeralError as exc:
        raise fail(exc) from exc
    typer.echo(f"{name} -> {image}")


@images_app.command("list")
def images_list() -> None:
    """Cached images (the current build of each definition is marked *), then pulled ones."""
    from ephemeral.cli import registry_images

    settings = Settings.load()
    rows = images.list_images(settings)
    if not rows:
        typer.echo("no images built (ephemeral images build)")
    for info in rows:
        mark = "*" if info.current else " "
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(info.built_at))
        typer.echo(
            f"{mark} {info.name:<12} {info.hash[:16]}  {info.size_bytes / 1e6:7.1f} MB  "
            f"{when}  {info.path}"
        )
    registry_images.list_pulled(settings)


@images_app.command("rm")
def images_rm(
    name: Annotated[str, typer.Argument(help="The image whose builds to delete.")] = "default",
    stale: Annotated[bool, typer.Option("--stale", help="Only builds of old definitions.")] = False,
    base: Annotated[bool, typer.Option("--base", help="Also the mmdebstrap base layers.")] = False,
) -> None:
    """Delete cached builds of image NAME (a pulled reference: forget it; `images gc` frees
    its layers)."""
    from ephemeral.cli import registry_images
    from ephemeral.oci.reference import is_reference

    settings = Settings.load()
    if is_reference(name):
        registry_images.remove_pulled(settings, name)
        return
    for path in images.remove_images(settings, name, all_versions=not stale, include_base=base):
        typer.echo(f"removed {path}")


@images_app.command("gc")
def images_gc(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="List what would be removed; remove nothing.")
    ] = False,
    max_mib: Annotated[
        int | None,
        typer.Option(
            "--max-mib",
            min=0,
            help="Keep the cache within this size (default EPHEMERAL_IMAGE_CACHE_MAX_MIB; "
            "0 removes every build and layer that may go).",
        ),
    ] = None,
) -> None:
    """Remove what dead builds left, then the least recently used builds and base layers no
    live sandbox or pool uses, until the cache fits (docs/images.md)."""
    from ephemeral.sandbox import image_gc

    settings = Settings.load()
    limit = max_mib << 20 if max_mib is not None else None
    chosen = image_gc.collect(settings, dry_run=dry_run, max_bytes=limit)
    verb = "would remove" if dry_run else "removed"
    for e in chosen:
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(e.last_used))
        typer.echo(f"{verb} {e.kind:<5} {e.size_bytes / 1e6:7.1f} MB  last used {when}  {e.path}")
    kept = [e for e in image_gc.entries(settings) if e not in chosen] if dry_run else None
    total = sum(e.size_bytes for e in kept) if kept is not None else None
    if not chosen:
        typer.echo("nothing to remove")
    if total is not None:
        typer.echo(f"would keep {total / 1e6:.1f} MB")


def register(app: typer.Typer) -> None:
    """Add this group's commands to the main app."""
    app.add_typer(sandbox_app, name="sandbox")
    from ephemeral.cli import prebuild, registry_images

    registry_images.register(images_app)
    prebuild.register(images_app)
    app.add_typer(images_app, name="images")
    app.command("isolation")(isolation_cmd)
