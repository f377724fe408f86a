"""Dockerfiles ``FROM`` a registry image (issue 36, item 5): built on the image's stored layers
under a writable layer of their own, the result the base's layers plus one new layer in the
same store, booted by a sandbox; ``RUN`` reaches the network only through the build's proxy,
only to hosts of ``build_allow_hosts``, each request recorded.

The base is a static busybox with no Python (pushed to the loopback registry); the network is a
real HTTP server on 127.0.0.1, named ``localhost`` (allowed past the SSRF rule by
``broker_allow_private_hosts``, as the egress tests do)."""

from __future__ import annotations

import asyncio
import http.server
import json
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ephemeral import errors
from ephemeral.cli import app
from ephemeral.oci.reference import parse
from ephemeral.oci.store import LayerStore
from ephemeral.sandbox import images
from ephemeral.sandbox import registry as drivers_registry
from ephemeral.sandbox.base import Limits
from ephemeral.sandbox.dockerfile import build_dockerfile
from ephemeral.settings import Settings
from tests.drivers import unavailable
from tests.oci import layouts as L
from tests.oci.conftest import Registry
from tests.sandbox.conftest import busybox_tree

INSTALL_SH = b"mkdir -p /opt/tool && echo installed-by-curl-sh > /opt/tool/marker\n"


@pytest.fixture(scope="session")
def busybox_ref(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``<registry>/test/busybox:1``: a static busybox, no Python, one layer, a config with
    Env and WorkingDir."""
    tmp = tmp_path_factory.mktemp("busybox-image")
    root = tmp / "rootfs"
    busybox_tree(root)
    (root / "etc" / "motd").write_text("base motd\n")
    (root / "srv").mkdir()
    members = sorted(p.name for p in root.iterdir())
    registry.push_image(
        tmp,
        "test/busybox:1",
        [L.tar_of_tree(root, members)],
        config={"Env": ["PATH=/bin", "BASE_VAR=from-base"], "WorkingDir": "/srv"},
    )
    return f"{registry.host}/test/busybox:1"


@pytest.fixture
def web() -> Iterator[str]:
    """A loopback HTTP server serving ``/install.sh``; yields ``localhost:PORT``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = INSTALL_SH if self.path == "/install.sh" else b"no\n"
            self.send_response(200 if self.path == "/install.sh" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"localhost:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _dockerfile(tmp: Path, text: str) -> Path:
    d = Path(tempfile.mkdtemp(dir=tmp))
    (d / "Dockerfile").write_text(text)
    return d / "Dockerfile"


def _allowing(settings: Settings, hosts: list[str]) -> Settings:
    """A build allow list, and the loopback server reachable past the SSRF rule."""
    return settings.model_copy(
        update={"broker_allow_private_hosts": True, "build_allow_hosts": hosts}
    )


def _session_output(settings: Settings, image: str, command: str) -> str:
    isolation = "namespaces"
    why = asyncio.run(drivers_registry.probe_level(isolation, Settings.load()))
    if why is not None:
        unavailable(f"{isolation} cannot run here: {why}", isolation)

    async def go() -> str:
        at = settings.model_copy(update={"image": image})
        driver = drivers_registry.get_driver(isolation, at)
        sbx = await driver.create(owner="test", limits=Limits())
        try:
            return (await sbx.exec(command, user="root")).stdout
        finally:
            await sbx.destroy()

    return asyncio.run(go())


def test_from_a_registry_image_builds_on_its_layers_and_boots(
    oci_settings: Settings, busybox_ref: str, tmp_path: Path
) -> None:
    df = _dockerfile(
        tmp_path,
        f"FROM {busybox_ref}\n"
        "ENV TOOL=yes\n"
        'RUN echo "$BASE_VAR $(pwd)" > /srv/seen && rm /etc/motd\n'
        "WORKDIR /app\n"
        "RUN echo built > marker\n",
    )
    built = build_dockerfile(df, name="from-busybox", settings=oci_settings)
    store = LayerStore(oci_settings)
    base = store.resolve(parse(busybox_ref))
    assert base is not None
    # the base's stored layers, then one new layer, then the agent's: no flattened copy
    base_layers = [store.layer_root(x.diff_id) for x in base.layers]
    assert built.pulled and built.layers[: len(base_layers)] == base_layers
    new = built.layers[len(base_layers)]
    assert (new / "app" / "marker").read_text() == "built\n"
    assert not (new / "bin" / "busybox").exists()  # the base's files stay in its layer
    assert (new / "etc" / "motd").is_char_device()  # a whiteout, in overlayfs form
    assert (new / "srv" / "seen").read_text() == "from-base /srv\n"  # the config's Env, cwd
    assert not (built.rootfs.parent.parent / "rootfs").exists()
    assert (built.env["TOOL"], built.env["BASE_VAR"], built.cwd) == ("yes", "from-base", "/app")
    # the built image keeps its layers in the store: a reference names it
    assert any(r.startswith("localhost/ephemeral-build/from-busybox:") for r in store.references())
    out = _session_output(
        oci_settings,
        "from-busybox",
        "cat /app/marker; test -e /etc/motd || echo motd-gone; "
        "test -e /usr/bin/python3 || echo no-python",
    )
    assert out.split() == ["built", "motd-gone", "no-python"]
    # the same inputs: the cache answers, nothing is built again
    again = build_dockerfile(df, name="from-busybox", settings=oci_settings)
    assert again.hash == built.hash and again.layers == built.layers
    # gc keeps the new layer while the build is here, and drops it once the build is removed
    assert store.gc().layers == [] and new.is_dir()
    images.remove_images(oci_settings, "from-busybox")
    report = store.gc()
    assert report.refs and not new.exists() and all(p.is_dir() for p in base_layers)


def test_copy_from_an_image(oci_settings: Settings, busybox_ref: str, tmp_path: Path) -> None:
    df = _dockerfile(
        tmp_path,
        f"FROM {busybox_ref}\nCOPY --from={busybox_ref} /etc/motd /copied/motd\n",
    )
    built = build_dockerfile(df, name="copy-from-image", settings=oci_settings)
    assert (built.layers[-2] / "copied" / "motd").read_text() == "base motd\n"


def test_run_is_offline_without_an_allow_list(
    oci_settings: Settings, busybox_ref: str, tmp_path: Path, web: str
) -> None:
    settings = oci_settings.model_copy(update={"broker_allow_private_hosts": True})
    df = _dockerfile(
        tmp_path, f"FROM {busybox_ref}\nRUN wget -qO /i.sh http://{web}/install.sh && sh /i.sh\n"
    )
    with pytest.raises(errors.DockerfileError) as info:
        build_dockerfile(df, name="offline", settings=settings)
    assert info.value.line == 2 and "RUN" in str(info.value)
    assert images.built_image(settings, "offline") is None


def test_run_reaches_an_allowed_host_through_the_proxy_and_it_is_recorded(
    oci_settings: Settings,
    busybox_ref: str,
    tmp_path: Path,
    web: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = _allowing(oci_settings, ["localhost"])
    df = _dockerfile(
        tmp_path,
        f"FROM {busybox_ref}\nRUN wget -qO- http://{web}/install.sh | sh && env | grep -c proxy\n",
    )
    built = build_dockerfile(df, name="curl-sh", settings=settings)
    assert (built.layers[-2] / "opt" / "tool" / "marker").read_text() == "installed-by-curl-sh\n"
    entry = images.image_dir(settings, "curl-sh")
    record = json.loads((entry / "network.json").read_text())
    port = int(web.split(":")[1])
    assert record["allow"] == ["localhost"]
    assert [
        {k: r[k] for k in ("method", "host", "port", "allowed")} for r in record["requests"]
    ] == [{"method": "GET", "host": "localhost", "port": port, "allowed": True}]
    assert record["requests"][0]["bytes_in"] > len(INSTALL_SH)
    assert "/install.sh" not in json.dumps(record)  # no path, query or header is kept
    meta = json.loads((entry / "image.json").read_text())
    assert meta["network"]["requests"] == 1 and meta["network"]["denied"] == 0
    out = _session_output(settings, "curl-sh", "cat /opt/tool/marker; env | grep -ci proxy")
    assert out.split() == ["installed-by-curl-sh", "0"]  # the proxy is the build's only
    # `images build` says what the RUNs asked for (the build is cached: the same record)
    for k, v in {
        "EPHEMERAL_STATE_DIR": settings.state_dir,
        "EPHEMERAL_CACHE_DIR": settings.cache_dir,
        "EPHEMERAL_REGISTRY_CA_FILE": settings.registry_ca_file,
        "EPHEMERAL_REGISTRY_PRIVATE_HOSTS": json.dumps(settings.registry_private_hosts),
        "EPHEMERAL_BUILD_ALLOW_HOSTS": json.dumps(["localhost"]),
    }.items():
        monkeypatch.setenv(k, str(v))
    cli = CliRunner().invoke(app, ["images", "build", "--dockerfile", str(df), "--name", "curl-sh"])
    assert cli.exit_code == 0, cli.output
    assert f"network: 1 requests, 0 refused ({entry / 'network.json'})" in cli.output


def test_a_host_not_allowed_fails_the_build_naming_it(
    oci_settings: Settings, busybox_ref: str, tmp_path: Path, web: str
) -> None:
    settings = _allowing(oci_settings, ["mirror.example.org"])
    df = _dockerfile(
        tmp_path, f"FROM {busybox_ref}\nRUN wget -qO /i.sh http://{web}/install.sh && sh /i.sh\n"
    )
    with pytest.raises(errors.DockerfileError) as info:
        build_dockerfile(df, name="denied", settings=settings)
    text = str(info.value)
    assert "refused GET localhost" in text and "not in the build's allow list" in text, text


def test_the_build_network_reaches_nothing_but_the_proxy(
    oci_settings: Settings, busybox_ref: str, tmp_path: Path, web: str
) -> None:
    """A RUN that ignores http_proxy and dials the host's loopback server directly finds
    nothing there: its network namespace holds only the proxy."""
    settings = _allowing(oci_settings, ["localhost"])
    port = web.split(":")[1]
    df = _dockerfile(
        tmp_path,
        f"FROM {busybox_ref}\nRUN http_proxy= wget -qO- -T 5 http://127.0.0.1:{port}/install.sh\n",
    )
    with pytest.raises(errors.DockerfileError) as info:
        build_dockerfile(df, name="direct", settings=settings)
    assert info.value.line == 2 and info.value.instruction == "RUN"


def test_the_allow_list_takes_host_names_only() -> None:
    assert Settings.load(
        build_allow_hosts=["Mirror.Example.org", "*.files.example.com"]
    ).build_allow_hosts == [
        "mirror.example.org",
        "*.files.example.com",
    ]
    for bad in ("127.0.0.1", "*.org", "http://x.org", "10.1"):
        with pytest.raises(ValueError, match="build_allow_hosts"):
            Settings.load(build_allow_hosts=[bad])


def test_a_debian_registry_image_with_stages_users_and_copies(
    oci_settings: Settings, registry: Registry, tmp_path: Path
) -> None:
    """A glibc image with GNU tools (the ``default`` rootfs pushed as two layers): a stage of
    it copied from, ``COPY --chown`` of the context, ``useradd``, ``USER`` (the image's
    ``setpriv``) and a ``WORKDIR`` the user owns, all on the stored layers."""
    from tests.harbor import registry_tasks as rt

    ref = rt.Pushed(registry, rt.base_layers()).push(tmp_path, "test/debian:1", {"etc/x": "1"})
    df = _dockerfile(
        tmp_path,
        f"FROM {ref} AS tools\n"
        "RUN echo from-stage > /stage-file\n"
        f"FROM {ref}\n"
        "COPY --from=tools /stage-file /copied/\n"
        "COPY --chown=1500:1500 hello.txt /home/alice/\n"
        "RUN /usr/sbin/useradd -m -u 1500 alice\n"  # the config's PATH has no sbin, as in Docker
        "USER alice\n"
        "WORKDIR /home/alice/w\n"
        "RUN id -un > who && cat ../hello.txt >> who\n",
    )
    (df.parent / "hello.txt").write_text("hello\n")
    built = build_dockerfile(df, name="debian-stages", settings=oci_settings)
    new = built.layers[-2]
    assert (new / "home/alice/w/who").read_text() == "alice\nhello\n"
    assert (new / "copied/stage-file").read_text() == "from-stage\n"
    assert (new / "home/alice/w").stat().st_uid == 1500  # the image's ids, shifted back
    assert "alice:x:1500" in (new / "etc/passwd").read_text()
    assert built.rootfs == new and (built.user, built.cwd) == ("alice", "/home/alice/w")
    out = _session_output(oci_settings, "debian-stages", "cat /home/alice/w/who; id -u alice")
    assert out.split() == ["alice", "hello", "1500"]
