"""Hostile image definitions: what a definition controls runs in the build sandbox and reads
nothing of the host; file sources stay in the definition; pip items are requirements only."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.sandbox import build_sandbox, images
from ephemeral.sandbox.base import Limits
from ephemeral.sandbox.gvisor import GVisorDriver
from ephemeral.sandbox.namespaces import NamespacesDriver
from ephemeral.sandbox.uid_ranges import RANGE_BASE
from ephemeral.settings import REPO_ROOT
from tests.drivers import required, unavailable
from tests.sandbox.image_cache import isolated_settings


@pytest.fixture
def defs(tmp_path: Path) -> Path:
    d = tmp_path / "images"
    for name in ("default", "python-dev"):
        shutil.copytree(
            REPO_ROOT / "sandbox_images" / name,
            d / name,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    return d


def _image(defs: Path, name: str, text: str) -> Path:
    d = defs / name
    (d / "data").mkdir(parents=True, exist_ok=True)
    (d / "data" / "hello.txt").write_text("hello\n")
    (d / "image.yaml").write_text(f"name: {name}\n{text}")
    return d


def _field_error(d: Path) -> dict[str, object]:
    with pytest.raises(errors.InvalidRequest) as exc:
        images.load_definition(d)
    return (exc.value.errors or [{}])[0]


# ---------------------------------------------------------------- file sources


@pytest.mark.parametrize(
    "source",
    ["../default/image.yaml", "/etc/hostname", "data/../../default/image.yaml", "out", "tree"],
)
def test_a_file_source_outside_the_definition_is_refused_naming_the_field(
    defs: Path, tmp_path: Path, source: str
) -> None:
    d = _image(
        defs,
        "hostile",
        "base: default\nfiles:\n  - {source: data/hello.txt, path: /opt/a}\n"
        f"  - {{source: {source}, path: /opt/b}}\n",
    )
    outside = tmp_path / "host-secret"
    outside.mkdir()
    (outside / "secret").write_text("host secret\n")
    (d / "out").symlink_to(outside / "secret")  # a symlink out of the definition
    (d / "tree").mkdir()
    (d / "tree" / "inner").symlink_to(outside)  # a tree holding a symlink out
    first = _field_error(d)
    assert first["field"] == "files[1].source", first
    assert "definition" in str(first["message"])


def test_a_symlink_inside_the_definition_is_a_fine_source(defs: Path) -> None:
    d = _image(defs, "linked", "base: default\nfiles:\n  - {source: alias, path: /opt/a}\n")
    (d / "alias").symlink_to("data/hello.txt")
    assert images.load_definition(d).files[0].source == "alias"


def test_the_agent_and_shim_sources_are_confined_too(defs: Path) -> None:
    y = defs / "default" / "image.yaml"
    y.write_text(y.read_text().replace("source: guest/agent.py", "source: /etc/passwd"))
    assert _field_error(defs / "default")["field"] == "agent.source"
    y.write_text(
        y.read_text().replace("source: /etc/passwd", "source: guest/agent.py")
        + "preload:\n  - {source: ../../../etc/shadow, path: /usr/lib/shim.so}\n"
    )
    assert _field_error(defs / "default")["field"] == "preload[0].source"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("files:\n  - {source: data/hello.txt, path: /opt/../../../tmp/x}\n", "files[0].path"),
        ("files:\n  - {source: data/hello.txt, path: /opt//x}\n", "files[0].path"),
    ],
)
def test_an_image_path_with_dot_dot_is_refused(defs: Path, text: str, field: str) -> None:
    d = _image(defs, "hostile", "base: default\n" + text)
    assert _field_error(d)["field"] == field


def test_a_symlink_out_is_hashed_as_a_name_never_read(defs: Path, tmp_path: Path) -> None:
    d = _image(defs, "hashed", "base: default\n")
    secret = tmp_path / "secret"
    secret.write_text("one")
    (d / "link").symlink_to(secret)
    first = images.definition_hash(d)
    secret.write_text("two")
    assert images.definition_hash(d) == first


# ---------------------------------------------------------------- pip items


@pytest.mark.parametrize(
    "item",
    [
        "--index-url http://127.0.0.1:9/simple",
        "--extra-index-url=http://127.0.0.1:9/simple",
        "-r requirements.txt",
        "-e .",
        "-i http://127.0.0.1:9/simple",
        "git+https://127.0.0.1/x/y.git",
        "pkg @ https://127.0.0.1/pkg-1.0-py3-none-any.whl",
        "http://127.0.0.1/pkg-1.0-py3-none-any.whl",
        "./data/hello.txt",
        "./../default/x.whl",
        "numpy; --index-url x",
        # pip reads a name with an archive extension (or a slash, or file:) as a local file
        # and runs its build backend: the fourth red-team's evil.tgz
        "evil.tgz",
        "evil.tar.lz",
        "evil.zip",
        "sub/evil",
        "file:evil.tgz",
    ],
)
def test_a_pip_item_that_is_not_a_requirement_is_refused(defs: Path, item: str) -> None:
    d = _image(defs, "hostile", f"base: default\npip:\n  - pytest==8.0\n  - {item!r}\n")
    first = _field_error(d)
    assert first["field"] == "pip[1]", first


@pytest.mark.parametrize(
    "item", ["pytest==8.0", "requests[socks]>=2,<3", 'tomli; python_version < "3.11"', "a-b.c_d"]
)
def test_requirement_specifiers_are_accepted(defs: Path, item: str) -> None:
    d = _image(defs, "fine", f"base: default\npip:\n  - {item!r}\n")
    assert images.load_definition(d).pip == [item]


# ---------------------------------------------------------------- the build sandbox, for real

PROBE = """\
set +e
{{
  id -u; cat /proc/self/uid_map
  echo "hostname=$(hostname) etc=$(cat /etc/hostname)"
  cat {canary} 2>&1 || echo canary-unreadable
  cat /proc/1/root{canary} 2>&1 || echo proc1-unreadable
  (cd /proc/1/root && cat .{canary}) 2>&1 || echo cd-proc1-unreadable
  python3 -c "
import asyncio
import os
os.makedirs('/esc', exist_ok=True)
fd = os.open('/', os.O_RDONLY)
os.chroot('/esc'); os.fchdir(fd)
for _ in range(64): os.chdir('..')
os.chroot('.')
print(open('{canary}').read())" 2>&1 | tail -1 || true
  echo written > {outside}/escaped 2>&1 || echo write-refused
  echo written > /proc/1/root{outside}/escaped2 2>&1 || echo write2-refused
  ls / | tr '\\n' ' '; echo
}} > /opt/report.txt
rmdir /esc
mkdir -p {outside}
ln -s {outside} /opt/outlink
"""


def _hostile_chain(defs: Path, canary: Path, outside: Path) -> Path:
    _image(
        defs,
        "hostile-base",
        "base: default\nbuild:\n  - |\n"
        + "".join(
            f"    {line}\n" for line in PROBE.format(canary=canary, outside=outside).split("\n")
        ),
    )
    # the child's file goes through the symlink its base left: into the image, not the host
    return _image(
        defs,
        "hostile",
        "base: hostile-base\nfiles:\n  - {source: data/hello.txt, path: /opt/outlink/hello.txt}\n"
        "build:\n  - yes build-output | head -c 20000000\n",
    )


@pytest.mark.sandbox
async def test_a_hostile_build_step_sees_and_writes_nothing_of_the_host(
    defs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("bwrap") is None:
        unavailable("bwrap missing")
    outside = tmp_path / "host-side"
    outside.mkdir()
    canary = outside / "canary"
    canary.write_text("HOST-CANARY-7f3a\n")
    _hostile_chain(defs, canary, outside)
    settings = isolated_settings(tmp_path, defs, "hostile", monkeypatch)
    rootfs = await images.ensure_image(settings, "hostile")
    report = (rootfs / "opt" / "report.txt").read_text()
    assert "HOST-CANARY" not in report, report
    lines = report.splitlines()
    assert lines[0] == "0"  # root of its namespace ...
    inside, host, count = lines[1].split()
    assert (inside, count) == ("0", "65536") and int(host) >= RANGE_BASE  # ... not host root
    assert lines[2] == "hostname=build etc=sandbox"
    for word in ("canary-unreadable", "proc1-unreadable", "cd-proc1-unreadable"):
        assert word in report
    assert "write-refused" in report and "write2-refused" in report
    assert sorted(os.listdir(outside)) == ["canary"]  # nothing written on the host
    # the child's file copy through the base's symlink (it succeeded: the image is built)
    # resolved in the sandbox, whose /tmp is its own tmpfs: the host directory is untouched
    # ownership is shifted back: the image's root files belong to host root again
    st = (rootfs / "opt" / "report.txt").stat()
    assert (st.st_uid, st.st_gid) == (0, 0)
    assert os.stat(rootfs / "usr" / "bin" / "su").st_mode & 0o4000  # set-uid bit kept


@pytest.mark.sandbox
async def test_a_failing_step_names_itself_and_its_output_is_bounded(
    defs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _image(defs, "noisy", "base: default\nbuild:\n  - yes noise | head -c 30000000; exit 3\n")
    settings = isolated_settings(tmp_path, defs, "noisy", monkeypatch)
    with pytest.raises(errors.SandboxError) as exc:
        await images.ensure_image(settings, "noisy")
    assert "noisy: build[0] failed (exit 3)" in exc.value.detail
    assert len(exc.value.detail) < 5000


@pytest.mark.sandbox
async def test_a_build_step_has_no_network(
    defs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host service on loopback is out of reach: the step's 127.0.0.1 is its own namespace's
    (up, with nothing listening), so the connection is refused, not accepted."""
    import socket

    with socket.socket() as host_service:
        host_service.bind(("127.0.0.1", 0))
        host_service.listen(8)
        port = host_service.getsockname()[1]
        probe = (
            'python3 -c "import socket; s = socket.socket(); '
            f"print(s.connect_ex(('127.0.0.1', {port})))\" > /opt/net.txt"
        )
        _image(defs, "offline", f"base: default\nbuild:\n  - |\n    {probe}\n")
        settings = isolated_settings(tmp_path, defs, "offline", monkeypatch)
        rootfs = await images.ensure_image(settings, "offline")
    assert (rootfs / "opt" / "net.txt").read_text().strip() == "111"  # ECONNREFUSED


@pytest.mark.sandbox
@pytest.mark.parametrize("name", ["default", "python-dev"])
async def test_the_shipped_images_rebuild_in_the_sandbox_and_run(
    defs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    settings = isolated_settings(tmp_path, defs, name, monkeypatch)
    rootfs = await images.ensure_image(settings, name)
    assert rootfs.is_relative_to(tmp_path)
    built = images.built_image(settings, name)
    assert built is not None and built.hash == images.definition_hash(defs / name)
    leftover = [
        p for p in rootfs.rglob("*") if not p.is_symlink() and p.lstat().st_uid >= RANGE_BASE
    ]
    assert leftover == []
    assert (rootfs.parent.stat().st_mode & 0o777) == 0o700
    check = "python3 -m pytest --version" if name == "python-dev" else "python3 -V"
    ran = 0
    for driver in (
        NamespacesDriver(settings.model_copy(update={"image": name})),
        GVisorDriver(settings.model_copy(update={"image": name})),
    ):
        if why := await driver.probe():
            if driver.isolation in required():
                unavailable(f"{driver.isolation}: {why}", driver.isolation)  # fails
            continue
        async with await driver.create(owner="test-image-build", limits=Limits()) as sbx:
            res = await sbx.exec(f"{check} && id -un", timeout=60)
        assert res.exit_code == 0, (driver.isolation, res.stderr)
        assert res.stdout.splitlines()[-1] == "worker"
        ran += 1
    if not ran:
        unavailable("neither namespaces nor gvisor starts here", "namespaces", "gvisor")


def test_the_build_sandbox_shows_no_host_path() -> None:
    argv = build_sandbox.bwrap_argv(Path("/run/ephemeral/build/1/0"), {"A": "1"})
    binds = [argv[i + 1] for i, a in enumerate(argv) if "bind" in a]
    assert binds == ["/run/ephemeral/build/1/0"]  # the image's mount point, nothing of the host
    assert "--unshare-net" in argv and "--die-with-parent" in argv
    assert "--share-net" not in argv


def test_shifting_owners_round_trips(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "d").mkdir(parents=True)
    f = root / "d" / "f"
    f.write_text("x")
    os.chown(f, 1000, 1000)
    os.chmod(f, 0o4755)
    os.link(f, root / "hard")
    (root / "l").symlink_to("/nonexistent")
    base = RANGE_BASE + 7 * (1 << 16)
    build_sandbox.shift_owners(root, base, lo=0, hi=1 << 16)
    assert (f.stat().st_uid, (root / "l").lstat().st_uid) == (base + 1000, base)
    build_sandbox.shift_owners(root, -base, lo=base, hi=base + (1 << 16))
    st = f.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1000, 1000, 0o4755)
    assert (root / "l").lstat().st_uid == 0


def _alive_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline.split(b"\0"):
            found.append(int(pid))
    return found


@pytest.mark.sandbox
async def test_a_step_past_its_time_limit_is_killed_with_everything_it_started(
    defs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = "4242.4242"  # an argv word only this test's processes carry
    step = f"(sleep {marker} &) ; setsid sleep {marker} & sleep {marker}"
    _image(defs, "stuck", f"base: default\nbuild:\n  - {step!r}\n")
    settings = isolated_settings(tmp_path, defs, "stuck", monkeypatch)
    monkeypatch.setattr(images, "BUILD_STEP_TIMEOUT_S", 5.0)
    with pytest.raises(errors.SandboxError, match=r"stuck: build\[0\] timed out"):
        await images.ensure_image(settings, "stuck")
    deadline = asyncio.get_running_loop().time() + 30
    while _alive_with(marker) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.2)
    assert _alive_with(marker) == []
    assert images.built_image(settings, "stuck") is None


@pytest.mark.sandbox
async def test_an_executable_build_step_runs_in_the_sandbox_with_its_out_dir(
    defs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _image(defs, "stepped", "base: default\n")
    step = d / "extra" / "build-step"
    step.parent.mkdir()
    step.write_text(
        '#!/bin/sh\nset -e\ncat /proc/self/uid_map > "$2/uid_map"\n'
        'test -f "$1/opt/ephemeral/agent.py" && echo "$1" > "$2/root"\n'
        f'cat {tmp_path}/cache/../images/stepped/image.yaml > "$2/host" 2>&1 || true\n'
    )
    step.chmod(0o755)
    settings = isolated_settings(tmp_path, defs, "stepped", monkeypatch)
    rootfs = await images.ensure_image(settings, "stepped")
    out = rootfs.parent / "extra"
    assert int((out / "uid_map").read_text().split()[1]) >= RANGE_BASE
    assert (out / "root").read_text() == "/\n"
    assert "No such file" in (out / "host").read_text()  # the definition's host path is not there
    assert (out / "uid_map").stat().st_uid == 0  # shifted back


@pytest.mark.sandbox
async def test_a_source_only_host_root_may_read_fails_the_build_naming_it(
    defs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _image(
        defs, "private", "base: default\nfiles:\n  - {source: data/hello.txt, path: /opt/h}\n"
    )
    (d / "data" / "hello.txt").chmod(0o600)
    settings = isolated_settings(tmp_path, defs, "private", monkeypatch)
    with pytest.raises(errors.SandboxError, match=r"private: files\[0\] failed"):
        await images.ensure_image(settings, "private")


@pytest.mark.sandbox
async def test_mmdebstrap_and_what_it_runs_are_not_host_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The package layer (whose maintainer scripts an author picks by naming packages) is
    built as root of a user namespace on a uid range: a hook in mmdebstrap's context, where
    the maintainer scripts run, is uid 0 inside and an unprivileged host uid outside; the
    layer's files belong to host root again after. (A tiny ``extract`` layer: one package,
    and a hook run where mmdebstrap runs dpkg and its maintainer scripts.)"""
    from ephemeral.settings import Settings

    def argv(spec: dict[str, object], target: Path) -> list[str]:
        hook = 'id -u > "$1"/who; cat /proc/self/uid_map >> "$1"/who'
        return [
            "mmdebstrap",
            "--mode=unshare",
            "--variant=extract",
            "--include=dash",
            f"--extract-hook={hook}",
            "bookworm",
            str(target),
        ]

    monkeypatch.setattr(images, "_mmdebstrap_argv", argv)
    settings = Settings.load(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache")
    rootfs = await images._ensure_base(settings, {"packages": ["dash"], "test": str(tmp_path)})
    uid, inside, outside, count = (rootfs / "who").read_text().split()
    assert (uid, inside, count) == ("0", "0", "65536")
    assert int(outside) >= RANGE_BASE  # never host root, never a real user
    dash = rootfs / "bin" / "dash"
    assert (dash.stat().st_uid, dash.stat().st_gid) == (0, 0)
    assert not list(settings.image_cache_dir.glob("base/*.partial"))


def test_the_hosts_pip_gets_no_secret_of_the_callers_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ephemeral.sandbox import host_pip

    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    env = host_pip._env(tmp_path)
    assert env["PIP_INDEX_URL"] == "http://127.0.0.1:9/simple"  # the mirrors pip is set up for
    assert "OPENAI_API_KEY" not in env and "sk-secret" not in env.values()
    assert env["HOME"] == str(tmp_path)
