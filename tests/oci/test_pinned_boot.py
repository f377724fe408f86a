"""A run boots the digest its admission recorded (issue 36): admission resolves a registry
reference to its manifest digest (the run's ``image_hash``); a ``pull`` that re-points the
reference before the run's sandbox boots, and a ``gc`` that removes the admitted image's
layers, change nothing for that run: it boots the admitted bytes (pulled again by digest when
they are gone here), never what the name means by then. The same for a session whose boot
waits after its admission.

A real registry on loopback, real sandboxes (namespaces, gvisor); the images are Debian's static
busybox plus a layer that differs between the two images."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from ephemeral.oci import pull as oci_pull
from ephemeral.oci import sandbox_image
from ephemeral.oci.reference import parse
from ephemeral.oci.store import LayerStore
from ephemeral.policy import RunRequest
from ephemeral.sandbox import registry as drivers_registry
from ephemeral.sessions.requests import ExecRequest, SessionRequest
from ephemeral.settings import Settings
from tests import runlevel
from tests.api.conftest import write_cassette
from tests.drivers import unavailable
from tests.oci import layouts as L
from tests.oci.conftest import PASSWORD, USER, Registry
from tests.run.conftest import turn
from tests.sandbox.conftest import busybox_tree

pytestmark = pytest.mark.sandbox

SHOW = "cat /etc/which-image; echo $WHICH"


def _push(registry: Registry, tmp: Path, ref: str, base: bytes, which: str) -> str:
    """``base`` plus a layer and an Env naming ``which``, pushed as ``ref``; returns the
    manifest digest's hex."""
    digest = registry.push_image(
        tmp / which,
        ref.split("/", 1)[1],
        [base, L.tar([L.file("etc/which-image", f"{which}\n")])],
        config={"Env": ["PATH=/bin", f"WHICH={which}"]},
    )
    return digest.split(":", 1)[1]


async def _name(
    registry: Registry, tmp: Path, isolation: str, name: str
) -> tuple[str, Callable[[str], str]]:
    """Skips when ``isolation`` cannot run; else ``<registry>/test/NAME:1`` and a function
    that pushes an image under it (returning its digest's hex)."""
    why = await drivers_registry.probe_level(isolation, Settings.load())
    if why is not None:
        unavailable(f"{isolation} cannot run here: {why}", isolation)
    tree = tmp / "busybox" / "rootfs"
    busybox_tree(tree)
    base = L.tar_of_tree(tree, ["bin", "etc"])
    ref = f"{registry.host}/test/{name}:1"
    return ref, lambda which: _push(registry, tmp, ref, base, which)


def _delete_manifest(registry: Registry, ref: str, hex_digest: str) -> None:
    repo = ref.split("/", 1)[1].rsplit(":", 1)[0]
    gone = httpx.delete(
        f"https://{registry.host}/v2/{repo}/manifests/sha256:{hex_digest}",
        auth=(USER, PASSWORD),
        verify=ssl.create_default_context(cafile=str(registry.ca_file)),
    )
    assert gone.status_code == 202, gone.text


@pytest.mark.parametrize("isolation", ["namespaces", "gvisor"])
async def test_a_run_boots_its_admitted_digest_after_the_name_moves(
    oci_settings: Settings, registry: Registry, tmp_path: Path, isolation: str
) -> None:
    ref, push = await _name(registry, tmp_path, isolation, f"pinned-{isolation}")
    first = push("first")
    cassettes = tmp_path / "cassettes"
    cassettes.mkdir()
    model = write_cassette(cassettes, "pinned", [turn(SHOW), turn(final="ok")])
    settings = oci_settings.model_copy(
        update={"cassettes_dir": cassettes, "use_prefect": False, "default_model": model}
    )
    store = LayerStore(settings)
    async with runlevel.started(settings) as rt:
        org = await rt.local_org()
        request = RunRequest(
            prompt="go", image=ref, isolation=isolation, timeout_seconds=60, max_cost_micros=40_000
        )
        moved, gone, lost = [(await rt.admit(org, request))[0] for _ in range(3)]
        assert moved.image_hash == gone.image_hash == lost.image_hash == first  # at admission
        rt.taken = {moved.id, gone.id, lost.id}  # admitted and taken, as a worker takes runs
        # the name moves before either run boots: a new image under the tag, pulled again
        second = push("second")
        assert (await oci_pull.pull(settings, ref)).hex == second != first
        resolved = store.resolve(parse(ref))
        assert resolved is not None and resolved.hex == second

        row = await rt.execute(moved.id)
        assert row.status == "succeeded", row.termination_detail
        assert (row.image, row.image_hash) == (ref, first)
        events = await rt.store.events.list(row.id)
        ready = next(e.data for e in events if e.type == "sandbox.ready")
        assert (ready["image"], ready["image_hash"]) == (ref, first)
        shown = next(e.data for e in events if e.type == "shell.executed")
        assert shown["stdout"] == "first\nfirst\n", shown

        # the admitted image's own layer is collected (nothing names it now): the run pulls
        # that digest again from the registry, and still boots it
        report = await asyncio.to_thread(store.gc)
        assert f"sha256:{first}" in report.images and store.image(f"sha256:{first}") is None
        row = await rt.execute(gone.id)
        assert row.status == "succeeded", row.termination_detail
        shown = next(
            e.data for e in await rt.store.events.list(row.id) if e.type == "shell.executed"
        )
        assert shown["stdout"] == "first\nfirst\n", shown
        assert row.image_hash == first

        # gone here and gone from the registry: the run fails saying so, and boots nothing
        store.remove_ref(parse(sandbox_image.pinned_reference(ref, first)))
        await asyncio.to_thread(store.gc)
        _delete_manifest(registry, ref, first)
        row = await rt.execute(lost.id)
        assert (row.status, row.termination_reason) == ("failed", "infra_error")
        assert f"the image admitted as {ref} (sha256:{first}) is no longer on this host" in (
            row.termination_detail or ""
        ), row.termination_detail
        assert row.sandbox_id is None
        assert not [e for e in await rt.store.events.list(row.id) if e.type == "sandbox.ready"]

        # a run admitted now gets what the name means now
        late = (await rt.admit(org, request))[0]
        assert late.image_hash == second
        # never executed: cancelled, so its hold goes back (the run-level check asks it)
        assert (await rt.cancel(late.id)).status == "cancelled"


async def test_a_session_boots_its_admitted_digest_when_its_boot_waits(
    oci_settings: Settings, registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session's boot held after its admission (as boots wait for a slot) while the name
    moves: its sandbox, its Env and its recorded digest are the admitted image's."""
    isolation = "namespaces"
    ref, push = await _name(registry, tmp_path, isolation, "pinned-session")
    first = push("first")
    settings = oci_settings.model_copy(update={"use_prefect": False})
    async with runlevel.started(settings) as rt:
        source = rt.sessions.sandboxes
        real_acquire = source.acquire
        booting, release = asyncio.Event(), asyncio.Event()

        async def held(*args: object, **kwargs: object) -> object:
            booting.set()
            await release.wait()
            return await real_acquire(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(source, "acquire", held)
        org = await rt.local_org()
        request = SessionRequest(image=ref, isolation=isolation, timeout_seconds=60)
        create = asyncio.create_task(rt.sessions.create(org, request))
        await booting.wait()
        second = push("second")
        assert (await oci_pull.pull(settings, ref)).hex == second != first
        release.set()
        row, _ = await create
        assert row.status == "running", row.termination_detail
        try:
            got = await rt.sessions.exec(row.id, None, ExecRequest(command=SHOW))
            assert got.stdout == "first\nfirst\n", got
            events = await rt.store.events.list(row.id)
            ready = next(e.data for e in events if e.type == "sandbox.ready")
            assert (ready["image"], ready["image_hash"]) == (ref, first)
            assert (await rt.sessions.get(row.id)).image_hash == first
        finally:
            await rt.sessions.end(row.id)
