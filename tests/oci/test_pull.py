"""Pulls from a real registry on loopback (TLS, htpasswd): layers stored once, in overlay form,
the platform chosen from an index, zstd, the config honoured, and hostile images refused."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import ssl
import stat
import subprocess
from pathlib import Path

import httpx
import pytest

from ephemeral import errors
from ephemeral.oci import pull as oci_pull
from ephemeral.oci.store import LayerStore, PulledImage, du
from ephemeral.settings import Settings
from tests.oci import layouts as L
from tests.oci.conftest import PASSWORD, USER, Registry
from tests.oci.token_server import TokenServer


def _ctx(registry: Registry) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(registry.ca_file))


def _pull(settings: Settings, ref: str) -> PulledImage:
    return asyncio.run(oci_pull.pull(settings, ref))


def merged_listing(lowers: list[Path], *paths: str) -> str:
    """``ls -A`` of ``paths`` in the kernel's overlay of ``lowers`` (lowest first), as a
    sandbox's root would show them (mounted in a private mount namespace)."""
    lowerdir = ":".join(str(p) for p in reversed(lowers))
    script = (
        'm=$(mktemp -d) && mount -t overlay x -o "lowerdir=$0" "$m" && '
        'for p in "$@"; do echo "$p:" $(ls -A "$m/$p" 2>&1); done'
    )
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, lowerdir, *paths],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


BASE = [
    L.directory("etc"),
    L.file("etc/os-release", "ID=test\n"),
    L.directory("a"),
    L.file("a/x", "x"),
    L.file("a/y", "y"),
    L.directory("opq"),
    L.file("opq/old", "old"),
    L.file("bin/tool", "#!/bin/sh\n", mode=0o4755),
    L.Entry("home/app", kind=b"5", mode=0o755, uid=1000, gid=1000),
    L.Entry("home/app/notes", b"mine", uid=1000, gid=1001),
    L.Entry("home/app/link", kind=b"2", link="notes", uid=1000, gid=1000),
]
TOP = [
    L.file("a/.wh.x"),
    L.directory("opq"),
    L.file("opq/.wh..wh..opq"),
    L.file("opq/new", "new"),
    L.symlink("b/link", "/etc/os-release"),
    L.file("b/z", "z"),
    L.hardlink("b/z2", "b/z"),
]


def test_layers_unpack_once_in_overlay_form(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    digest = registry.push_image(
        tmp_path,
        "test/wh:1",
        [L.tar(BASE), L.tar(TOP)],
        config={"Env": ["PATH=/usr/bin:/bin", "A=b=c"], "WorkingDir": "/srv", "User": "1000:1000"},
    )
    image = _pull(oci_settings, f"{registry.host}/test/wh:1")
    assert image.digest == digest
    assert image.env == {"PATH": "/usr/bin:/bin", "A": "b=c"}
    assert (image.workdir, image.user) == ("/srv", "1000:1000")
    store = LayerStore(oci_settings)
    base, top = (store.layer_root(layer.diff_id) for layer in image.layers)
    wh = os.lstat(top / "a" / "x")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == os.makedev(0, 0)
    assert os.getxattr(top / "opq", "trusted.overlay.opaque") == b"y"
    assert os.readlink(top / "b" / "link") == "/etc/os-release"  # stored, never followed
    assert os.stat(top / "b" / "z").st_ino == os.stat(top / "b" / "z2").st_ino
    assert not os.stat(base / "bin" / "tool").st_mode & (stat.S_ISUID | stat.S_ISGID)
    owners = {p: (st.st_uid, st.st_gid) for p in ("home/app", "home/app/notes", "home/app/link",
              "etc/os-release") if (st := os.lstat(base / p))}  # fmt: skip
    assert owners == {
        "home/app": (1000, 1000),
        "home/app/notes": (1000, 1001),
        "home/app/link": (1000, 1000),
        "etc/os-release": (0, 0),
    }
    assert (store.root.stat().st_mode & 0o777) == 0o700
    listing = merged_listing([base, top], "a", "opq", "b")
    assert "a: y\n" in listing and "opq: new\n" in listing and "b: link z z2\n" in listing
    # no compressed layer kept: the unpacked tree is the stored form
    assert not any(p.name == image.layers[0].digest.split(":")[1] for p in store.blobs.iterdir())
    # pulled again: nothing is downloaded or unpacked again
    before = {p: p.stat().st_ino for p in store.layers.iterdir()}
    again = _pull(oci_settings, f"{registry.host}/test/wh:1")
    assert again.digest == digest
    assert {p: p.stat().st_ino for p in store.layers.iterdir()} == before


def test_images_sharing_a_base_store_it_once(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    base = L.tar([L.file(f"usr/lib/f{i}", os.urandom(64 << 10)) for i in range(64)])  # 4 MiB
    tops = [L.tar([L.file(f"app/{n}", os.urandom(256 << 10))]) for n in range(4)]
    for n, top in enumerate(tops):
        registry.push_image(tmp_path, f"test/shared{n}:1", [base, top])
    store = LayerStore(oci_settings)
    for n in range(4):
        _pull(oci_settings, f"{registry.host}/test/shared{n}:1")
    layers = sorted(store.layers.iterdir())
    assert len(layers) == 5  # one base + four tops
    unique = sum(du(p) for p in layers)
    whole = du(store.root)
    print(f"store {whole} bytes, unique layers {unique} bytes, ratio {whole / unique:.3f}")
    # the rest is manifests, configs, refs and records: a few KiB per image
    assert unique <= whole <= unique * 1.05 + (64 << 10)
    assert whole < 2 * len(base) + sum(len(t) for t in tops)  # a copy per image would be 4x base


def test_index_gives_linux_amd64_and_zstd_layers_unpack(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    layout = L.Layout(tmp_path / "multi")
    amd = layout.image(
        [L.tar([L.file("arch", "amd64")]), L.tar([L.file("z", "zstd layer")])],
        compression=["gzip", "zstd"],
    )
    arm = layout.image([L.tar([L.file("arch", "arm64")])], arch="arm64")
    index = layout.index([arm, amd])
    layout.tag(index, "multi")
    layout.close()
    registry.push(layout.root, "multi", "test/multi:1", all_images=True)
    image = _pull(oci_settings, f"{registry.host}/test/multi:1")
    assert image.digest == amd["digest"]
    store = LayerStore(oci_settings)
    first, second = (store.layer_root(layer.diff_id) for layer in image.layers)
    assert (first / "arch").read_text() == "amd64"
    assert (second / "z").read_text() == "zstd layer"
    # by the index's digest too
    pinned = _pull(oci_settings, f"{registry.host}/test/multi@{index['digest']}")
    assert pinned.digest == amd["digest"]


def test_arm64_only_is_refused_naming_what_it_has(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    layout = L.Layout(tmp_path / "arm")
    arm = layout.image([L.tar([L.file("arch", "arm64")])], arch="arm64")
    layout.tag(layout.index([arm]), "arm")
    layout.close()
    registry.push(layout.root, "arm", "test/arm:1", all_images=True)
    with pytest.raises(errors.InvalidRequest, match=r"no linux/amd64 image.*linux/arm64"):
        _pull(oci_settings, f"{registry.host}/test/arm:1")


# ---- hostile images: each is refused, nothing is written outside the store


HOSTILE = {
    "traversal": [L.file("../../escaped", "x")],
    "absolute": [L.file("/escaped-abs", "x")],
    "link-out-then-write": [L.symlink("evil", "/tmp"), L.file("evil/pwned", "x")],
    "hardlink-out": [L.hardlink("passwd", "../../../../etc/passwd")],
    "whiteout-dotdot": [L.directory("d"), L.file("d/.wh...")],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_layers_are_refused(
    oci_settings: Settings, registry: Registry, tmp_path: Path, case: str
) -> None:
    registry.push_image(tmp_path, f"test/hostile-{case}:1", [L.tar(HOSTILE[case])])
    with pytest.raises(errors.InvalidRequest) as exc:
        _pull(oci_settings, f"{registry.host}/test/hostile-{case}:1")
    assert "layer" in exc.value.detail
    store = LayerStore(oci_settings)
    assert not list(store.layers.iterdir())  # nothing committed
    assert not list(store.tmp.glob("layer-*"))  # the attempt's files are gone
    assert not Path("/tmp/pwned").exists() and not Path("/escaped-abs").exists()
    assert not (store.tmp.parent.parent / "escaped").exists()


def test_decompression_bomb_is_cut_at_the_limit(
    registry: Registry, tmp_path: Path, oci_settings: Settings
) -> None:
    bomb = L.tar([L.file("zeros", bytes(40 << 20))])  # 40 MiB of zeros: ~40 KiB gzipped
    registry.push_image(tmp_path, "test/bomb:1", [bomb])
    small = oci_settings.model_copy(update={"image_max_unpacked_mib": 8})
    with pytest.raises(errors.InvalidRequest, match=r"image_max_unpacked_mib|over"):
        _pull(small, f"{registry.host}/test/bomb:1")
    assert du(LayerStore(small).root) < 9 << 20


def test_a_blob_that_does_not_match_its_digest_is_refused(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    registry.push_image(tmp_path, "test/corrupt:1", [L.tar([L.file("f", "good")])])
    manifest = json.loads(
        httpx.get(
            f"https://{registry.host}/v2/test/corrupt/manifests/1",
            headers={"Accept": L.OCI_MANIFEST},
            auth=(USER, PASSWORD),
            verify=_ctx(registry),
        ).content
    )
    layer = manifest["layers"][0]
    blob = registry.blob_file(layer["digest"])
    evil = gzip.compress(L.tar([L.file("f", "evil")]), mtime=0)[: layer["size"]]
    blob.write_bytes(evil.ljust(layer["size"], b"\0"))  # same size, other bytes
    with pytest.raises(errors.InvalidRequest, match="does not match its digest"):
        _pull(oci_settings, f"{registry.host}/test/corrupt:1")
    assert not list(LayerStore(oci_settings).layers.iterdir())


def test_a_manifest_pointing_at_a_huge_config_is_refused_unread(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    registry.push_image(tmp_path, "test/hugeconf:1", [L.tar([L.file("f", "x")])])
    auth = (USER, PASSWORD)
    base = f"https://{registry.host}/v2/test/hugeconf/manifests"
    manifest = json.loads(
        httpx.get(
            f"{base}/1", headers={"Accept": L.OCI_MANIFEST}, auth=auth, verify=_ctx(registry)
        ).content
    )
    manifest["config"]["size"] = 1 << 30
    put = httpx.put(
        f"{base}/huge",
        content=json.dumps(manifest).encode(),
        headers={"Content-Type": L.OCI_MANIFEST},
        auth=auth,
        verify=_ctx(registry),
    )
    assert put.status_code == 201, put.text
    with pytest.raises(errors.InvalidRequest, match="config is 1073741824 bytes"):
        _pull(oci_settings, f"{registry.host}/test/hugeconf:huge")


def test_wrong_credentials_and_unknown_ca_fail_clearly(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    from ephemeral.oci.credentials import Credential, CredentialStore

    registry.push_image(tmp_path, "test/auth:1", [L.tar([L.file("f", "x")])])
    CredentialStore(oci_settings).set(registry.host, Credential(username=USER, password="wrong"))
    with pytest.raises(errors.RegistryError, match="HTTP 401"):
        _pull(oci_settings, f"{registry.host}/test/auth:1")
    no_ca = oci_settings.model_copy(update={"registry_ca_file": None})
    CredentialStore(no_ca).set(registry.host, Credential(username=USER, password=PASSWORD))
    # TLS fails; loopback may fall back to plain http (Docker's rule), which this TLS-only
    # registry does not speak: either way, no pull
    with pytest.raises(errors.RegistryError):
        _pull(no_ca, f"{registry.host}/test/auth:1")


def test_private_addresses_need_the_operator(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    """A request names the registry: a loopback one is refused unless listed."""
    unlisted = oci_settings.model_copy(update={"registry_private_hosts": []})
    with pytest.raises(errors.RegistryError, match="loopback"):
        _pull(unlisted, f"{registry.host}/test/wh:1")


def test_gc_removes_what_no_reference_reaches(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    from ephemeral.oci.reference import parse

    shared = L.tar([L.file("base", "b")])
    registry.push_image(tmp_path, "test/gc1:1", [shared, L.tar([L.file("one", "1")])])
    registry.push_image(tmp_path, "test/gc2:1", [shared, L.tar([L.file("two", "2")])])
    one = _pull(oci_settings, f"{registry.host}/test/gc1:1")
    two = _pull(oci_settings, f"{registry.host}/test/gc2:1")
    store = LayerStore(oci_settings)
    assert store.gc().layers == []  # everything is referenced
    assert store.remove_ref(parse(f"{registry.host}/test/gc1:1"))
    report = store.gc()
    assert report.images == [one.digest]
    assert report.layers == [one.layers[1].diff_id]  # the shared base stays
    assert store.resolve(parse(f"{registry.host}/test/gc2:1")) == two
    assert all(store.layer_info(layer.diff_id) for layer in two.layers)


def test_bearer_tokens_as_docker_hub_and_ghcr_issue_them(
    token_registry: tuple[Registry, TokenServer], tmp_path: Path
) -> None:
    """The registry answers 401 with ``WWW-Authenticate: Bearer realm=…``: the client gets a
    token for ``repository:<path>:pull`` from the realm, anonymously, then with the stored
    credentials as Basic."""
    from ephemeral.oci.credentials import Credential, CredentialStore

    reg, tokens = token_registry
    reg.push_image(tmp_path, "test/anon:1", [L.tar([L.file("f", "anonymous")])])
    settings = Settings.load(
        state_dir=tmp_path / "state",
        cache_dir=tmp_path / "cache",
        registry_ca_file=reg.ca_file,
        registry_private_hosts=[reg.host, f"127.0.0.1:{tokens.port}"],
    )
    tokens.asked.clear()
    image = _pull(settings, f"{reg.host}/test/anon:1")
    fs = LayerStore(settings).layer_root(image.layers[0].diff_id)
    assert (fs / "f").read_text() == "anonymous"
    assert tokens.asked[0] == {
        "scope": ["repository:test/anon:pull"],
        "service": "test-registry",
        "basic": False,
    }
    CredentialStore(settings).set(reg.host, Credential(username="u", password="p"))
    tokens.asked.clear()
    _pull(settings, f"{reg.host}/test/anon:1")
    assert tokens.asked and tokens.asked[0]["basic"] is True


def test_the_connection_goes_to_the_address_that_was_checked(
    oci_settings: Settings, registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``registry.test`` resolves nowhere; the address check answers 127.0.0.1 for it. The pull
    works only if the client dials the checked address (a DNS answer that changed after the
    check would not be used) while TLS still verifies the certificate for the name."""
    import ipaddress

    from ephemeral.broker import ssrf
    from ephemeral.oci import registry as client
    from ephemeral.oci.credentials import Credential, CredentialStore

    registry.push_image(tmp_path, "test/dial:1", [L.tar([L.file("f", "dialed")])])
    port = registry.host.split(":")[1]
    checked: list[str] = []

    async def fake_resolve(url: httpx.URL, *, allow_private: bool) -> ssrf.Target:
        checked.append(f"{url.host}:{allow_private}")
        return ssrf.Target(url=url, address=ipaddress.ip_address("127.0.0.1"))

    monkeypatch.setattr(client, "resolve", fake_resolve)
    name = f"registry.test:{port}"
    settings = oci_settings.model_copy(update={"registry_private_hosts": [name]})
    CredentialStore(settings).set(name, Credential(username=USER, password=PASSWORD))
    image = _pull(settings, f"{name}/test/dial:1")
    fs = LayerStore(settings).layer_root(image.layers[0].diff_id)
    assert (fs / "f").read_text() == "dialed"
    assert checked and set(checked) == {"registry.test:True"}


def test_images_gc_sizes_the_layers_with_the_builds(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    """``ephemeral images gc`` (sandbox/image_gc.py): first what no reference reaches goes,
    then layers by last use, never one a sandbox mounts; an image that lost a layer is pulled
    again when named."""
    import subprocess as sp

    from ephemeral.oci.reference import parse
    from ephemeral.sandbox import cache_use, image_gc

    shared = L.tar([L.file("base", os.urandom(64 << 10))])
    registry.push_image(tmp_path, "test/lru1:1", [shared, L.tar([L.file("one", "1")])])
    registry.push_image(tmp_path, "test/lru2:1", [shared, L.tar([L.file("two", "2")])])
    one = _pull(oci_settings, f"{registry.host}/test/lru1:1")
    two = _pull(oci_settings, f"{registry.host}/test/lru2:1")
    store = LayerStore(oci_settings)
    store.remove_ref(parse(f"{registry.host}/test/lru1:1"))
    kinds = {e.path.name: e.last_used for e in image_gc.entries(oci_settings) if e.kind == "layer"}
    assert kinds[one.layers[1].diff_id.split(":")[1]] == 0.0  # unreferenced: first to go
    image_gc.collect(oci_settings)  # under the size limit: only the unreferenced layer goes
    assert store.layer_info(one.layers[1].diff_id) is None
    assert all(store.layer_info(layer.diff_id) for layer in two.layers)
    # now everything, as --max-mib 0: the base is mounted by a "sandbox", the top is old
    for layer in two.layers:
        os.utime(store.layer_dir(layer.diff_id) / cache_use.USED, (1, 1))
    base = store.layer_root(two.layers[0].diff_id)
    holder = sp.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'm=$(mktemp -d) && mount --bind "{base}" "$m" && echo ok && exec sleep 60'],
        stdout=sp.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ok\n"
        gone = image_gc.collect(oci_settings, max_bytes=0)
    finally:
        holder.kill()
        holder.wait()
    assert [e.path.name for e in gone] == [two.layers[1].diff_id.split(":")[1]]
    assert store.layer_info(two.layers[0].diff_id) is not None  # in use: kept
    assert store.resolve(parse(f"{registry.host}/test/lru2:1")) is None  # incomplete now
    again = asyncio.run(oci_pull.ensure_image(oci_settings, f"{registry.host}/test/lru2:1"))
    assert again.digest == two.digest and store.complete(again)


def test_a_mirror_serves_a_registry_without_reaching_it(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    """``registry_mirrors``: ``docker.io`` references are pulled from the mirror only (here
    the loopback registry, holding ``library/mirrored``), with the mirror's credentials."""
    digest = registry.push_image(tmp_path, "library/mirrored:1", [L.tar([L.file("m", "hub")])])
    settings = oci_settings.model_copy(
        update={"registry_mirrors": {"docker.io": f"https://{registry.host}"}}
    )
    image = _pull(settings, "mirrored:1")  # docker.io/library/mirrored:1
    assert image.digest == digest and image.reference == "docker.io/library/mirrored:1"


def test_the_config_gives_a_session_its_defaults(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    """Env for every command; WorkingDir and User (its user part: `uid:gid` → `uid`) as a
    session exec's defaults; no User is root, as in Docker."""
    from ephemeral.oci import sandbox_image

    for tag, user, want in (("u", "1000:1000", "1000"), ("n", "", "root"), ("a", "app", "app")):
        registry.push_image(
            tmp_path,
            f"test/conf:{tag}",
            [L.tar([L.file(f"etc/{tag}", tag)])],
            config={"Env": ["K=v"], "WorkingDir": "/work", "User": user},
        )
        ref = f"{registry.host}/test/conf:{tag}"
        assert sandbox_image.built_image(oci_settings, ref) is None  # never pulls
        _pull(oci_settings, ref)
        got = sandbox_image.built_image(oci_settings, ref)
        assert got is not None and got.pulled
        assert (got.env, got.cwd, got.user) == ({"K": "v"}, "/work", want)
        assert got.layers[-1].name == "fs" and (got.layers[-1] / "opt").is_dir()  # the agent's
