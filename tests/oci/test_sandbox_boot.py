"""Sandboxes boot from a pulled image on both process isolations: the image's layers as the
overlay's read-only lower layers (whiteouts and opaque directories applied by the kernel),
under the sandbox's own writable layer; sessions get the config's Env, WorkingDir and User,
runs and sessions record the image's digest.

The image is the ``default`` image's rootfs (it has Python, which the guest agent still needs)
split into two layers, plus a third with a whiteout, an opaque directory and a marker."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager

import pytest

from ephemeral.oci.store import LayerStore
from ephemeral.sandbox import registry as drivers_registry
from ephemeral.sandbox.base import Limits
from ephemeral.settings import Settings
from tests.drivers import built_image, unavailable
from tests.oci import layouts as L
from tests.oci.conftest import MemberApi, Registry
from tests.sandbox.leaks import loop_devices

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "OCI_TEST": "from-config"}


@pytest.fixture(scope="session")
def python_image(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``<registry>/test/python:1``, pushed once per session; yields the reference."""
    root = built_image(Settings.load(), "default").rootfs
    top = sorted(p.name for p in root.iterdir() if p.name != "usr")
    whiteouts = L.tar(
        [
            L.file("etc/.wh.issue"),  # the base's /etc/issue is gone
            L.directory("var/cache"),
            L.file("var/cache/.wh..wh..opq"),  # the base's /var/cache contents are hidden
            L.file("var/cache/oci-only", "1"),
            L.file("etc/oci-marker", "third layer\n"),
        ]
    )
    tmp = tmp_path_factory.mktemp("python-image")
    layout = L.Layout(tmp / "layout")
    desc = layout.image(
        [L.tar_of_tree(root, ["usr"]), L.tar_of_tree(root, top), whiteouts],
        compression=["gzip", "zstd", "gzip"],
        config={"Env": [f"{k}={v}" for k, v in ENV.items()], "WorkingDir": "/srv"},
    )
    layout.tag(desc, "t")
    layout.close()
    registry.push(layout.root, "t", "test/python:1")
    shutil.rmtree(tmp)
    yield f"{registry.host}/test/python:1"


def _driver_settings(oci_settings: Settings, image: str, isolation: str) -> Settings:
    settings = oci_settings.model_copy(update={"image": image})
    why = asyncio.run(drivers_registry.probe_level(isolation, Settings.load()))
    if why is not None:
        unavailable(f"{isolation} cannot run here: {why}", isolation)
    return settings


@pytest.mark.parametrize("isolation", ["namespaces", "gvisor"])
def test_a_sandbox_boots_from_the_pulled_layers(
    oci_settings: Settings, python_image: str, isolation: str
) -> None:
    settings = _driver_settings(oci_settings, python_image, isolation)

    async def go() -> tuple[str, str, str]:
        sbx = await drivers_registry.get_driver(isolation, settings).create(
            owner="test", limits=Limits()
        )
        try:
            seen = await sbx.exec(
                "cat /etc/oci-marker; test -e /etc/issue || echo issue-gone; ls -A /var/cache; "
                "python3 -c 'print(6 * 7)'; id -u",
            )
            wrote = await sbx.exec(
                "echo mine > /etc/oci-marker && cat /etc/oci-marker", user="root"
            )
            denied = await sbx.exec("echo x > /etc/oci-marker", user="worker")
            return seen.stdout, wrote.stdout, str(denied.exit_code)
        finally:
            await sbx.destroy()

    seen, wrote, denied = asyncio.run(go())
    assert seen.split() == ["third", "layer", "issue-gone", "oci-only", "42", "1000"]
    assert wrote == "mine\n" and denied != "0"
    # the write landed in the sandbox's own layer: the stored layer is unchanged
    store = LayerStore(settings)
    layers = sorted(store.layers.iterdir())
    assert any(
        (p / "fs/etc/oci-marker").read_text() == "third layer\n"
        for p in layers
        if (p / "fs/etc/oci-marker").exists()
    )


@pytest.mark.parametrize("isolation", ["namespaces", "gvisor"])
def test_a_pulled_image_gets_a_disk_backed_root(
    oci_settings: Settings, python_image: str, isolation: str
) -> None:
    """Issue 36, item 7: the pulled layers under a writable layer on the host's disk (a
    ``disk_mib`` above ``disk_tmpfs_max_mib``): 400 MiB written beside a changed layer file,
    more than this sandbox's tmpfs could hold; its loop device goes with it."""
    settings = _driver_settings(oci_settings, python_image, isolation)

    async def go() -> tuple[str, list[str]]:
        sbx = await drivers_registry.get_driver(isolation, settings).create(
            owner="test", limits=Limits(memory_mib=512, disk_mib=1024)
        )
        try:
            assert loop_devices(sbx.id)
            res = await sbx.exec(
                "echo mine >> /etc/oci-marker && head -c 400M /dev/zero > /usr/big && "
                "cat /etc/oci-marker && stat -c %s /usr/big",
                user="root",
                timeout=300,
            )
            assert res.exit_code == 0, res
            return res.stdout, loop_devices(sbx.id)
        finally:
            await sbx.destroy()
            assert loop_devices(sbx.id) == []

    out, held = asyncio.run(go())
    assert out == f"third layer\nmine\n{400 << 20}\n" and held


async def test_runs_and_sessions_over_http_pull_at_admission_and_record_the_digest(
    oci_settings: Settings,
    python_image: str,
    member_api: Callable[[Settings, str], AbstractAsyncContextManager[MemberApi]],
) -> None:
    """As ``POST /v1/runs`` and ``POST /v1/sandboxes`` do: admission pulls (the image is not
    here yet), the run's commands run as worker with the config's Env, a session's exec
    defaults to the config's WorkingDir and User (root: it names none); the run object and the
    ready events carry the manifest's digest."""
    from ephemeral.oci.reference import parse

    isolation = "namespaces"
    why = await drivers_registry.probe_level(isolation, Settings.load())
    if why is not None:
        unavailable(f"{isolation} cannot run here: {why}", isolation)
    settings = oci_settings.model_copy(update={"use_prefect": False})
    assert LayerStore(settings).resolve(parse(python_image)) is None
    async with member_api(settings, "id -un; echo $OCI_TEST; cat /etc/oci-marker") as api:
        seen = await api.run(python_image, isolation, timeout_seconds=60)
        assert (seen.row["image"], seen.row["image_hash"]) == (python_image, seen.pulled_hex)
        assert seen.first("shell.executed")["stdout"] == "worker\nfrom-config\nthird layer\n"
        assert seen.first("sandbox.ready")["image_hash"] == seen.pulled_hex

        answer = await api.session_exec(python_image, isolation, 60, "pwd; id -u; echo $OCI_TEST")
        assert answer["stdout"] == "/srv\n0\nfrom-config\n", answer
        body = api.run_body("Not/Valid:ref", isolation, 60)
        bad = await api.http.post("/v1/runs", json=body, headers=api.headers)
        assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "image"
