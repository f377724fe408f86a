"""Image builds are bounded like sandboxes: a hostile Dockerfile that fills memory, processes,
the image's disk, its /tmp, or unpacks an ADD bomb fails its own build saying which limit it
hit, and leaves the host as it was (the cache as before, no build area, no cgroup, no mount);
what dead builds leave is swept; the cache is collected least recently used first, never what
a live sandbox uses; stage directories are host root's only; the Dockerfile is never read
through a link."""

from __future__ import annotations

import asyncio
import gzip
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.sandbox import build_area, build_sandbox, cache_use, image_gc, images
from ephemeral.sandbox import dockerfile as df
from ephemeral.sandbox.dockerfile import builder
from ephemeral.settings import Settings
from tests.sandbox.test_dockerfile import _linked


def _settings(tmp_path: Path, **limits: int) -> Settings:
    return Settings.load(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", **limits)


def _snapshot(cache: Path) -> dict[str, int]:
    """Every path of the cache (links not followed) and its size: the host's side of it."""
    out: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(cache):
        for name in [*dirnames, *filenames]:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, cache)] = os.lstat(p).st_size
    return out


def _record_cgroups(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every cgroup directory the builds of this test make (other builds may run on the host)."""
    made: list[Path] = []
    enter = build_sandbox.BuildCgroup.__enter__

    def recording(self: build_sandbox.BuildCgroup) -> build_sandbox.BuildCgroup:
        out = enter(self)
        assert self.cg is not None
        made.extend(self.cg.dirs)
        return out

    monkeypatch.setattr(build_sandbox.BuildCgroup, "__enter__", recording)
    return made


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if str(path) in line]


def _context(tmp_path: Path, text: str) -> Path:
    ctx = tmp_path / "ctx"
    ctx.mkdir(exist_ok=True)
    (ctx / "Dockerfile").write_text(text)
    return ctx


def _bomb(path: Path, members: int, size: int) -> None:
    """A gzip tar whose ``members`` files of ``size`` zero bytes compress to almost nothing."""
    with gzip.open(path, "wb", compresslevel=9) as gz, tarfile.open(fileobj=gz, mode="w|") as tar:
        for i in range(members):
            info = tarfile.TarInfo(f"f{i}")
            info.size = size
            tar.addfile(info, _Zeros(size))


class _Zeros(io.RawIOBase):
    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


EXHAUSTING = [
    pytest.param(
        "RUN python3 -c \"b = b'x' * (1 << 30); print(len(b))\"\n",
        {"build_memory_mib": 128},
        "out of memory",
        id="memory",
    ),
    pytest.param(
        "RUN i=0; while [ $i -lt 400 ]; do sleep 60 & i=$((i + 1)); done; wait\n",
        {"build_pids": 64},
        "out of processes",
        id="pids",
    ),
    pytest.param(
        "RUN head -c 1500M /dev/zero > /filler\n",
        {"build_disk_mib": 1024},
        "no space left",
        id="disk",
    ),
    pytest.param(
        "RUN head -c 256M /dev/zero > /tmp/filler\n",
        {"build_tmp_mib": 32},
        "no space left",
        id="tmp",
    ),
    pytest.param("ADD bomb.tar.gz /bomb/\n", {"build_add_max_mib": 16}, "16 MiB", id="add-bytes"),
    pytest.param(
        "ADD many.tar.gz /many/\n", {"build_add_max_files": 500}, "500 members", id="add-files"
    ),
]


@pytest.mark.sandbox
@pytest.mark.parametrize(("step", "limits", "why"), EXHAUSTING)
def test_an_exhausting_build_fails_its_own_build_and_leaves_the_host_as_it_was(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    step: str,
    limits: dict[str, int],
    why: str,
) -> None:
    monkeypatch.setattr(images, "build_with_image", lambda *_: None)
    settings = _settings(tmp_path, **limits)
    ctx = _context(tmp_path, "FROM debian:bookworm\nRUN true\n" + step)
    _bomb(ctx / "bomb.tar.gz", 1, 64 << 20)  # 64 MiB of zeros in about 64 KiB
    _bomb(ctx / "many.tar.gz", 1000, 0)
    plan, _, _ = df.load(ctx / "Dockerfile", None, {}, settings)
    _linked(settings, plan)
    before = _snapshot(settings.image_cache_dir)
    groups = _record_cgroups(monkeypatch)
    with pytest.raises(errors.DockerfileError) as exc:
        df.build_dockerfile(ctx / "Dockerfile", name="hostile", settings=settings)
    assert exc.value.line == 3, exc.value.detail
    assert why in exc.value.detail, exc.value.detail
    after = _snapshot(settings.image_cache_dir)
    # the name's lock file is all a failed build adds; no build area, no image
    assert {k for k in after if k not in before} <= {".hostile.lock"}, after.keys() - before.keys()
    assert {k: v for k, v in after.items() if k in before} == before
    assert not list(settings.image_cache_dir.glob("*.partial"))
    assert groups and not [d for d in groups if d.exists()]  # its cgroup and processes: gone
    assert _mounts_under(settings.image_cache_dir) == []
    assert images.built_image(settings, "hostile") is None


def test_an_add_bomb_is_measured_without_unpacking(tmp_path: Path) -> None:
    from ephemeral.sandbox.dockerfile.context import archive_bounds

    _bomb(tmp_path / "b.tar.gz", 4, 8 << 20)
    archive_bounds(tmp_path / "b.tar.gz", 32 << 20, 4)  # exactly at the bounds: fine
    with pytest.raises(ValueError, match="more than 16 MiB"):
        archive_bounds(tmp_path / "b.tar.gz", 16 << 20, 10)
    with pytest.raises(ValueError, match="more than 3 members"):
        archive_bounds(tmp_path / "b.tar.gz", 1 << 30, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.tar.gz"]


# ------------------------------------------------------------------ build areas


async def _dead_area(out: Path) -> Path:
    """A build area as a killed build leaves it: mounted, nobody holding its lock."""
    area = build_area.BuildArea(out, 256)
    await area.__aenter__()
    (area.fs / "junk").write_bytes(b"x" * 4096)
    assert area._lock is not None
    os.close(area._lock)  # the build's process is gone: so is its lock
    area._lock = None
    return area.path


@pytest.mark.sandbox
async def test_a_dead_builds_area_is_swept_and_a_live_one_kept(tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "images"
    dead = await _dead_area(cache / "dead-0123456789abcdef")
    dead_base = await _dead_area(cache / "base" / "0123456789abcdef")
    async with build_area.BuildArea(cache / "live-0123456789abcdef", 256) as live:
        assert _mounts_under(dead) and _mounts_under(live.path)
        gone = await asyncio.to_thread(build_area.sweep, cache)
        assert sorted(gone) == sorted([dead, dead_base])
        assert not dead.exists() and not dead_base.exists() and _mounts_under(dead) == []
        assert (live.fs).is_dir() and _mounts_under(live.path)
    assert not live.path.exists() and _mounts_under(cache) == []


@pytest.mark.sandbox
async def test_the_build_area_is_a_size_limited_filesystem_host_root_only(tmp_path: Path) -> None:
    async with build_area.BuildArea(tmp_path / "x-0123456789abcdef", 256) as area:
        assert stat.S_IMODE(area.path.stat().st_mode) == 0o700
        assert stat.S_IMODE(area.fs.stat().st_mode) == 0o700
        with pytest.raises(OSError) as exc, open(area.fs / "big", "wb") as f:
            for _ in range(300):
                f.write(bytes(1 << 20))
                f.flush()
                os.fsync(f.fileno())
        assert "No space left" in str(exc.value)
        image = area.path / "fs.img"
        assert image.stat().st_blocks * 512 <= 257 << 20  # the host holds at most the file
    assert not area.path.exists()


# ------------------------------------------------------------------ garbage collection


def _fake_entry(
    settings: Settings, name: str, size: int, age_s: float, d: Path | None = None
) -> Path:
    import json
    import time

    d = d or settings.image_cache_dir / f"{name}-{'ab' * 8}"
    (d / "rootfs").mkdir(parents=True)
    (d / "rootfs" / "blob").write_bytes(os.urandom(size))
    (d / "image.json").write_text(json.dumps({"name": name, "hash": "ab" * 32, "built_at": 1}))
    cache_use.mark_used(d)
    when = time.time() - age_s
    os.utime(d / cache_use.USED, (when, when))
    return d


def test_gc_removes_the_least_recently_used_first_and_keeps_what_is_used(
    tmp_path: Path,
) -> None:
    settings = _settings(tmp_path)
    oldest = _fake_entry(settings, "oldest", 300_000, 7200)
    older = _fake_entry(settings, "older", 300_000, 3600)
    recent = _fake_entry(settings, "recent", 300_000, 1)  # a run admitted a moment ago
    held = _fake_entry(settings, "held", 300_000, 9000)
    # the current build of a definition: a run naming `default` needs it (images rm only)
    current = _fake_entry(settings, "default", 1000, 99999, images.image_dir(settings))
    with open(held / "rootfs" / "blob", "rb"):  # a process has it open: it is in use
        dry = image_gc.collect(settings, dry_run=True, max_bytes=710_000)
        assert [e.path for e in dry] == [oldest, older]
        assert oldest.exists() and older.exists()  # a dry run removes nothing
        gone = image_gc.collect(settings, max_bytes=0)
        assert [e.path for e in gone] == [oldest, older]
    assert not oldest.exists() and not older.exists()
    assert recent.exists() and held.exists() and current.exists()


def test_gc_keeps_the_layer_of_a_definitions_current_build(tmp_path: Path) -> None:
    """The mmdebstrap layer a definition's current build was made on stays (a ``FROM NAME``
    Dockerfile builds on it, and it takes minutes and a mirror to make again); another layer,
    as old and unused, goes. A cache over its size once evicted python-dev's layer this way and
    every Dockerfile build on python-dev needed a mirror again."""
    import json

    settings = _settings(tmp_path)
    current = _fake_entry(settings, "default", 1000, 99999, images.image_dir(settings))
    layers = {}
    for name in ("a" * 16, "b" * 16):
        d = settings.image_cache_dir / "base" / name
        (d / "rootfs").mkdir(parents=True)
        (d / "rootfs" / "blob").write_bytes(os.urandom(1000))
        (d / "done").touch()
        os.utime(d / "done", (1, 1))
        layers[name] = d
    meta = json.loads((current / "image.json").read_text())
    (current / "image.json").write_text(json.dumps({**meta, "layer": "a" * 16}))
    gone = [e.path for e in image_gc.collect(settings, max_bytes=0)]
    assert gone == [layers["b" * 16]]
    assert layers["a" * 16].is_dir() and current.is_dir()


@pytest.mark.sandbox
@pytest.mark.parametrize("isolation", ["namespaces", "gvisor"])
async def test_gc_never_removes_the_image_of_a_live_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolation: str
) -> None:
    """A real sandbox booted from a Dockerfile image: its build stays through a collection
    that removes everything else not in use."""
    import time

    from ephemeral.sandbox.base import Limits
    from ephemeral.sandbox.registry import get_driver
    from tests.drivers import unavailable

    monkeypatch.setattr(images, "build_with_image", lambda *_: None)
    settings = _settings(tmp_path)
    ctx = _context(tmp_path, "FROM debian:bookworm\nRUN echo used > /marker\n")
    plan, _, _ = df.load(ctx / "Dockerfile", None, {}, settings)
    _linked(settings, plan)
    built = await df.abuild_dockerfile(ctx / "Dockerfile", name="used", settings=settings)
    other = _fake_entry(settings, "unused", 1000, 3600)
    old = time.time() - 3600
    for d in (built.rootfs.parent, other):
        os.utime(d / cache_use.USED, (old, old))
    driver = get_driver(isolation, settings.model_copy(update={"image": "used"}))
    if (why := await driver.probe()) is not None:
        unavailable(why, isolation)
    box = await driver.create(owner="test", limits=Limits())
    try:
        for d in (built.rootfs.parent, other):  # the boot marked it used: make it old again
            os.utime(d / cache_use.USED, (old, old))
        gone = [e.path for e in image_gc.collect(settings, max_bytes=0)]
        assert other in gone and built.rootfs.parent not in gone
        assert (await box.exec(["cat", "/marker"])).stdout == "used\n"
    finally:
        await box.destroy()


# ------------------------------------------------------------------ stages and the Dockerfile


@pytest.mark.sandbox
def test_an_earlier_stages_set_uid_file_is_in_host_root_only_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(images, "build_with_image", lambda *_: None)
    settings = _settings(tmp_path)
    ctx = _context(
        tmp_path,
        "FROM debian:bookworm AS build\n"
        "RUN cp /bin/sh /suid-sh && chmod 4755 /suid-sh\n"
        "FROM debian:bookworm\n"
        "COPY --from=build /suid-sh /opt/\n",
    )
    seen: list[tuple[int, list[int]]] = []
    copy_in = builder._copy_in

    async def watch(box, staged, plan, step, as_dir):  # type: ignore[no-untyped-def]
        # while the final stage builds: every directory from the cache down to the export
        found = next(staged.rglob("suid-sh"))
        chain = [p for p in found.parents if p.is_relative_to(settings.image_cache_dir)]
        seen.append((found.stat().st_mode, [stat.S_IMODE(p.stat().st_mode) for p in chain]))
        await copy_in(box, staged, plan, step, as_dir)

    monkeypatch.setattr(builder, "_copy_in", watch)
    plan, _, _ = df.load(ctx / "Dockerfile", None, {}, settings)
    _linked(settings, plan)
    root = df.build_dockerfile(ctx / "Dockerfile", name="staged", settings=settings).rootfs
    ((mode, modes),) = seen
    assert mode & stat.S_ISUID
    # some directory on the way is host root's only: no host user reaches the file
    assert any(m & 0o077 == 0 for m in modes), [oct(m) for m in modes]
    assert (root / "opt" / "suid-sh").is_file()


def test_a_dockerfile_that_is_a_symlink_is_refused_without_reading_it(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("ROOT:x:0:0:the host's first line\n")
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").symlink_to(secret)
    with pytest.raises(errors.DockerfileError) as exc:
        df.load(ctx / "Dockerfile", None, {}, settings)
    assert "symlink" in exc.value.detail and "ROOT" not in exc.value.detail
    # outside the context: refused too, whatever it holds
    outside = tmp_path / "Dockerfile.outside"
    outside.write_text("FROM debian:bookworm\n")
    with pytest.raises(errors.DockerfileError, match="inside the context"):
        df.load(outside, ctx, {}, settings)
    # a file that is no Dockerfile: its first word is not echoed either
    (ctx / "Dockerfile").unlink()
    (ctx / "Dockerfile").write_text("root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(errors.DockerfileError) as exc:
        df.load(ctx / "Dockerfile", None, {}, settings)
    assert "root" not in exc.value.detail.split(":", 2)[-1]


@pytest.mark.sandbox
def test_a_dead_builders_cgroup_is_emptied_and_removed_a_live_ones_kept() -> None:
    """A builder killed mid-build leaves its cgroup and the steps in it: the next sweep kills
    them and removes it; a live builder's cgroup stays."""
    import shlex
    import subprocess

    from ephemeral.sandbox import cgroups, handles
    from ephemeral.sandbox.base import Limits

    if (why := cgroups.available()) is not None:
        pytest.skip(why)
    builder = subprocess.Popen(["sleep", "30"])  # stands for the builder that dies
    started = handles.process_start_time(builder.pid)
    builder.kill()
    builder.wait()
    name = f"build-{builder.pid}-{started}-0a0b0c0d"
    dead = cgroups.CgroupSet.create(name, Limits())
    join = " && ".join(f"echo $$ > {shlex.quote(f)}" for f in dead.procs_files)
    step = subprocess.Popen(["/bin/sh", "-c", join + " && exec sleep 600"])
    try:
        while not dead.pids():
            assert step.poll() is None
        with build_sandbox.BuildCgroup(build_sandbox.BuildLimits()) as live:
            assert live.cg is not None
            gone = build_sandbox.sweep_cgroups()
            assert name in gone and live.id not in gone
            assert all(d.is_dir() for d in live.cg.dirs)
        assert not [d for d in dead.dirs if d.exists()]
        assert step.wait(timeout=10) == -9  # the step it left was killed
    finally:
        step.kill()
        step.wait()
        dead.remove()
