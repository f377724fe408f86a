"""Image definitions: validation with the field named, hashing, listing and removal."""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.sandbox import images
from ephemeral.settings import REPO_ROOT, Settings
from tests.patience import PATIENCE


@pytest.fixture
def defs(tmp_path: Path) -> Path:
    d = tmp_path / "images"
    shutil.copytree(
        REPO_ROOT / "sandbox_images" / "default",
        d / "default",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return d


def test_hash_changes_with_any_file_and_only_then(defs: Path) -> None:
    d = defs / "default"
    first = images.definition_hash(d)
    assert images.definition_hash(d) == first
    (d / "guest" / "agent.py").write_text((d / "guest" / "agent.py").read_text() + "\n# x\n")
    assert images.definition_hash(d) != first


@pytest.mark.parametrize("name", ["default", "python-dev", "mini-swe-agent"])
def test_a_shipped_image_hashes_the_same_in_another_checkout(tmp_path: Path, name: str) -> None:
    """The hash is of the definitions' content only (not their path, mtimes or build leftovers
    such as __pycache__), so a fresh clone, as CI makes, finds the images cached by an earlier one
    instead of building them again (the mini-swe-agent image takes minutes)."""
    shipped = REPO_ROOT / "sandbox_images"
    clone = tmp_path / "elsewhere" / "sandbox_images"
    shutil.copytree(
        shipped, clone, ignore=shutil.ignore_patterns("__pycache__"), copy_function=shutil.copy
    )
    (clone / name / "__pycache__").mkdir(exist_ok=True)
    (clone / name / "__pycache__" / "leftover.cpython-311.pyc").write_bytes(b"built here")
    assert images.definition_hash(clone / name) == images.definition_hash(shipped / name)


def test_the_microvm_boot_definition_is_not_part_of_the_image(defs: Path) -> None:
    """The initramfs is keyed by stage 0 and 2 (microvm_image): changing them rebuilds no
    rootfs, agent runtime or derived image."""
    d = defs / "default"
    first = images.definition_hash(d)
    stage0 = d / "microvm" / "stage0-init.sh"
    stage0.write_text(stage0.read_text() + "\n# x\n")
    assert images.definition_hash(d) == first


def test_bad_definition_names_the_field(defs: Path) -> None:
    y = defs / "default" / "image.yaml"
    y.write_text(y.read_text().replace("uid: 1000", "uid: 0"))
    with pytest.raises(errors.InvalidRequest) as exc:
        images.load_definition(defs / "default")
    assert "user.uid" in exc.value.detail


def test_list_and_remove_cached_builds(defs: Path, tmp_path: Path) -> None:
    settings = Settings.load(
        state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", images_dir=defs
    )
    current = images.image_dir(settings, "default")
    stale = settings.image_cache_dir / "default-0000000000000000"
    for d, h in ((current, "cur"), (stale, "old")):
        (d / "rootfs").mkdir(parents=True)
        (d / "image.json").write_text(json.dumps({"name": "default", "hash": h, "built_at": 1}))
    assert images.built_rootfs(settings) == current / "rootfs"
    listed = {i.path: i.current for i in images.list_images(settings)}
    assert listed == {current: True, stale: False}
    assert images.remove_images(settings, "default", all_versions=False) == [stale]
    assert images.remove_images(settings, "default") == [current]
    assert images.built_rootfs(settings) is None


def _waiting_on(lock: Path) -> int:
    """How many flock requests wait on ``lock`` (the kernel's /proc/locks marks them ``->``)."""
    ino = f":{os.stat(lock).st_ino} "
    return sum(
        1 for line in Path("/proc/locks").read_text().splitlines() if "->" in line and ino in line
    )


def test_removals_of_an_image_wait_for_its_build_and_for_each_other(
    defs: Path, tmp_path: Path
) -> None:
    """Two removals of one build beside its build (two checkouts' suites sharing the cache):
    each waits for the name's build lock and lists what is left once it holds it, so one
    removes the build and the other finds it gone. Without the lock both rmtrees ran at once
    and one failed with FileNotFoundError on a directory the other had taken."""
    settings = Settings.load(
        state_dir=tmp_path / "state", cache_dir=tmp_path / "cache", images_dir=defs
    )
    build = images.image_dir(settings, "default")
    for d in ("etc/apt/auth.conf.d", "etc/ld.so.conf.d", "usr/lib"):
        (build / "rootfs" / d).mkdir(parents=True)
    (build / "image.json").write_text(json.dumps({"name": "default", "hash": "h", "built_at": 1}))
    lock = images.name_lock_path(settings, "default")
    with ThreadPoolExecutor(2) as pool:
        with images.name_locked(settings, "default"):  # what a build of it holds
            removals = [pool.submit(images.remove_images, settings, "default") for _ in range(2)]
            deadline = time.monotonic() + PATIENCE
            while _waiting_on(lock) < 2:
                assert not any(r.done() for r in removals), "a removal did not wait for the build"
                assert time.monotonic() < deadline, "the removals neither waited nor ended"
                time.sleep(0.01)
            assert build.is_dir()
        got = sorted((r.result(timeout=PATIENCE) for r in removals), key=len)
    assert got == [[], [build]]
    assert images.built_rootfs(settings) is None


def test_missing_definition_is_a_clear_error(tmp_path: Path) -> None:
    settings = Settings.load(state_dir=tmp_path, images_dir=tmp_path)
    with pytest.raises(errors.InvalidRequest, match="image"):
        images.definition_dir(settings, "nope")


# ---------------------------------------------------------------- derived images (base:)

DERIVED = """\
name: child
base: default
packages: [make]
pip: [./wheels/tinyevalpkg-0.1-py3-none-any.whl]
files:
  - {source: data/hello.txt, path: /opt/child/hello.txt}
env: {CHILD_MARK: "yes"}
workdir: project
build:
  - echo built > /opt/child/built.txt
"""


def _derived(defs: Path, text: str = DERIVED) -> Path:
    d = defs / "child"
    (d / "data").mkdir(parents=True)
    (d / "data" / "hello.txt").write_text("hello from the definition\n")
    (d / "wheels").mkdir()
    (d / "wheels" / "tinyevalpkg-0.1-py3-none-any.whl").write_bytes(b"")  # _wheel() fills it
    (d / "image.yaml").write_text(text)
    return d


def test_a_derived_definition_inherits_and_adds(defs: Path) -> None:
    d = _derived(defs)
    layers = images.chain(d)
    assert [x.name for _, x in layers] == ["default", "child"]
    spec = images._layer_spec([x for _, x in layers])
    assert spec["packages"][-1] == "make" and spec["suite"] == "bookworm"


def test_the_hash_covers_the_base_hash(defs: Path) -> None:
    d = _derived(defs)
    first = images.definition_hash(d)
    agent = defs / "default" / "guest" / "agent.py"
    agent.write_text(agent.read_text() + "\n# changed\n")
    assert images.definition_hash(d) != first  # a changed base rebuilds the child


@pytest.mark.parametrize(
    ("text", "field", "line"),
    [
        (DERIVED.replace("packages: [make]", "pakages: [make]"), "pakages", 3),
        (DERIVED.replace("workdir: project", "workdir: ../up"), "workdir", 8),
        (DERIVED.replace("env: {CHILD_MARK", "env: {1BAD"), "env.1BAD", 7),
        (DERIVED + "user: {name: x, uid: 5, gid: 5}\n", "user", 11),
        (DERIVED.replace("data/hello.txt", "data/missing.txt"), "files[0].source", 6),
        (DERIVED.replace("base: default", "base: nothing-here"), "base", 2),
        (DERIVED.replace("  - echo built > /opt/child/built.txt", "  - {x: 1}"), "build[0]", 10),
    ],
)
def test_a_bad_definition_names_file_line_and_field(
    defs: Path, text: str, field: str, line: int
) -> None:
    d = _derived(defs, text)
    with pytest.raises(errors.InvalidRequest) as exc:
        images.load_definition(d)
    first = (exc.value.errors or [])[0]
    assert first["file"] == str(d / "image.yaml")
    assert first["field"] == field, exc.value.errors
    assert first["line"] == line, exc.value.errors
    assert exc.value.detail.startswith(f"{d / 'image.yaml'}:{line}: {field}")


def _wheel(path: Path) -> None:
    """A one-module wheel written by hand (pip installs it without building anything)."""
    import base64
    import hashlib
    import zipfile

    files = {
        "tinyevalpkg/__init__.py": b"VALUE = 42\n",
        "tinyevalpkg-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinyevalpkg\n"
        b"Version: 0.1\n",
        "tinyevalpkg-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\n"
        b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    record += "tinyevalpkg-0.1.dist-info/RECORD,,\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("tinyevalpkg-0.1.dist-info/RECORD", record)


NO_NET = (
    'python3 -c "import socket; s = socket.socket(); '
    "print(s.connect_ex(('127.0.0.1', 9)))\" > /opt/child/net.txt"
)


@pytest.mark.sandbox
async def test_a_derived_image_builds_pip_files_env_and_offline_steps(
    defs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built for real on the default image's cached mmdebstrap layer (no extra packages), then
    started in a namespaces sandbox: what each field put in is there."""
    from ephemeral.sandbox.base import Limits
    from ephemeral.sandbox.namespaces import NamespacesDriver
    from tests.drivers import unavailable
    from tests.sandbox.image_cache import isolated_settings

    text = DERIVED.replace("packages: [make]\n", "") + f"  - {NO_NET}\n"
    d = _derived(defs, text)
    _wheel(d / "wheels" / "tinyevalpkg-0.1-py3-none-any.whl")
    settings = isolated_settings(tmp_path, defs, "child", monkeypatch)
    try:
        await images.ensure_image(settings, "child")
        built = images.built_image(settings, "child")
        assert built is not None and built.base == "default"
        assert built.env == {"CHILD_MARK": "yes"} and built.workdir == "project"
        assert built.hash == images.definition_hash(d)
        driver = NamespacesDriver(settings.model_copy(update={"image": "child"}))
        if why := await driver.probe():
            unavailable(f"namespaces: {why}", "namespaces")
        async with await driver.create(owner="test-images", limits=Limits()) as sbx:
            res = await sbx.exec(
                "python3 -c 'import tinyevalpkg; print(tinyevalpkg.VALUE)'; "
                "cat /opt/child/hello.txt /opt/child/built.txt /opt/child/net.txt",
                timeout=30,
            )
        assert res.exit_code == 0, res.stderr
        lines = res.stdout.splitlines()
        assert lines[:3] == ["42", "hello from the definition", "built"]
        assert lines[3] == "111"  # ECONNREFUSED: the build step's loopback is its own
    finally:
        images.remove_images(settings, "child")


def test_a_cycle_of_bases_is_an_error_not_a_hang(defs: Path) -> None:
    for name, base in (("a", "b"), ("b", "a")):
        (defs / name).mkdir()
        (defs / name / "image.yaml").write_text(f"name: {name}\nbase: {base}\n")
    with pytest.raises(errors.InvalidRequest, match="cycle"):
        images.definition_hash(defs / "a")
    with pytest.raises(errors.InvalidRequest, match="cycle"):
        images.chain(defs / "a")


def test_a_run_naming_an_image_not_built_here_is_told_the_command_that_builds_it(
    tmp_path: Path,
) -> None:
    """`make demo` builds only `default`; a run naming `python-dev` there is refused, never
    left waiting on a minute-long build inside an API request."""
    settings = Settings.load(state_dir=tmp_path / "state", cache_dir=tmp_path / "cache")
    with pytest.raises(errors.InvalidRequest) as defined:
        images.require_built(settings, "python-dev")
    assert "'python-dev' is not built on this server (available: none;" in defined.value.detail
    assert "build it with `ephemeral images build python-dev`" in defined.value.detail
    with pytest.raises(errors.InvalidRequest) as undefined:
        images.require_built(settings, "nope")
    assert "build one with `ephemeral images build NAME`" in undefined.value.detail


@pytest.mark.sandbox
async def test_images_build_names_the_layer_its_build_was_made_on(
    defs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``images build NAME`` (``ensure_layer``) writes the build's mmdebstrap layer into its
    ``image.json``, where the cache's gc reads what to keep (tests/sandbox/test_build_limits.py);
    a build made before that field gets it too. Built for real on the shared default layer."""
    from tests.sandbox.image_cache import isolated_settings

    settings = isolated_settings(tmp_path, defs, "default", monkeypatch)
    layer = await images.ensure_layer(settings, "default")
    marker = images.image_dir(settings, "default") / "image.json"
    assert json.loads(marker.read_text())["layer"] == layer.parent.name
    assert (layer.parent / "done").is_file()
    older = {k: v for k, v in json.loads(marker.read_text()).items() if k != "layer"}
    marker.write_text(json.dumps(older))  # as a build made before the field
    assert await images.ensure_layer(settings, "default") == layer
    assert json.loads(marker.read_text()) == {**older, "layer": layer.parent.name}
