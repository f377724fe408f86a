"""An image built from a real Dockerfile (apt-get, pip, COPY with .dockerignore, ENV, ARG,
WORKDIR, USER), then a real session on it over the API, on gVisor and namespaces: the session
sees the files, the env, the cwd and the user the Dockerfile says.

The image is built once for the module in a cache of its own, on the shared mmdebstrap layer of
``python-dev`` (the Dockerfile's apt-get packages are all in it, so no mirror is asked)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from ephemeral.engine.runtime import Runtime
from ephemeral.sandbox import dockerfile, images
from ephemeral.sandbox.dockerfile import builder as df_builder
from ephemeral.settings import Settings
from tests import runlevel
from tests.api.conftest import Member
from tests.sandbox.image_cache import link_runtime_source, link_shared_layer

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

DOCKERFILE = """\
# syntax=docker/dockerfile:1
FROM python-dev
ARG GREETING=hello
ARG FLAVOUR
ENV APP_MODE="test mode" \\
    PATH=/opt/tools:$PATH
# packages the builder reads here go into the image's package layer
RUN apt-get update \\
 && apt-get install -y --no-install-recommends git make \\
 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir --break-system-packages six
WORKDIR /app
COPY . .
RUN pip install --break-system-packages -r requirements.txt
COPY --chown=1500:1500 data/ /srv/data/
RUN useradd -m -u 1500 alice \\
 && echo "$GREETING ${FLAVOUR:-plain}" > /app/greeting \\
 && mkdir -p /opt/tools \\
 && printf '#!/bin/sh\\necho tool says hi\\n' > /opt/tools/mytool \\
 && chmod 755 /opt/tools/mytool
USER alice
WORKDIR work
RUN id -un > whoami
CMD ["python3"]
"""


def _context(root: Path) -> Path:
    ctx = root / "ctx"
    (ctx / "data").mkdir(parents=True)
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    (ctx / "hello.txt").write_text("hello from the context\n")
    (ctx / "secret.txt").write_text("never copied\n")
    (ctx / "debug.log").write_text("ignored\n")
    (ctx / "keep.log").write_text("kept by an exception\n")
    (ctx / "data" / "x.csv").write_text("a,b\n")
    (ctx / "requirements.txt").write_text("# read in the image when the RUN comes\nappdirs\n")
    (ctx / ".dockerignore").write_text("secret.txt\n*.log\n!keep.log\n")
    return ctx


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Settings, images.ImageConfig]:
    root = tmp_path_factory.mktemp("dockerfile-image")
    settings = Settings.load(state_dir=root / "state", cache_dir=root / "cache")
    ctx = _context(root)
    plan, _, _ = dockerfile.load(ctx / "Dockerfile", None, {}, settings)
    shared = Settings.load()
    layers = images.chain(images.definition_dir(settings, plan.base))
    spec = images._layer_spec([d for _, d in layers], tuple(plan.packages))
    link_shared_layer(settings, shared, spec, of=" of python-dev")
    config = dockerfile.build_dockerfile(
        ctx / "Dockerfile", name="df-session", build_args={"FLAVOUR": "mint"}, settings=settings
    )
    return settings, config


def test_the_built_image_records_what_the_dockerfile_says(
    built: tuple[Settings, images.ImageConfig],
) -> None:
    settings, config = built
    assert config.name == "df-session" and config.base == "python-dev"
    assert (config.user, config.cwd, config.workdir) == ("alice", "/app/work", "/app/work")
    assert config.env["APP_MODE"] == "test mode"
    assert config.env["PATH"].startswith("/opt/tools:/usr/local/sbin:")
    assert config.env["PIP_NO_INDEX"] == "1"  # python-dev's env is the base's
    assert config.dockerfile is not None and config.dockerfile["cmd"] == ["python3"]
    assert images.built_image(settings, "df-session") == config
    listed = {i.name: i for i in images.list_images(settings)}
    assert listed["df-session"].current
    assert images.available(settings) == ["df-session"]
    rootfs = config.rootfs
    assert (rootfs / "app/hello.txt").read_text() == "hello from the context\n"
    assert not (rootfs / "app/secret.txt").exists() and not (rootfs / "app/debug.log").exists()
    assert (rootfs / "app/keep.log").is_file()
    assert (rootfs / "app/greeting").read_text() == "hello mint\n"
    assert (rootfs / "app/work/whoami").read_text() == "alice\n"
    assert (rootfs / "srv/data/x.csv").stat().st_uid == 1500
    assert (rootfs / "app/hello.txt").stat().st_uid == 0
    assert list((rootfs / "usr/local/lib").glob("python3*/dist-packages/six.py"))
    assert list((rootfs / "usr/local/lib").glob("python3*/dist-packages/appdirs.py"))


def test_a_second_build_is_a_cache_hit(built: tuple[Settings, images.ImageConfig]) -> None:
    settings, config = built
    ctx = Path(json.loads((config.rootfs.parent / "image.json").read_text())["dockerfile"]["path"])
    again = dockerfile.build_dockerfile(
        ctx, name="df-session", build_args={"FLAVOUR": "mint"}, settings=settings
    )
    assert again == config
    (ctx.parent / "hello.txt").write_text("changed\n")
    plan, ctx_files, data = dockerfile.load(ctx, None, {"FLAVOUR": "mint"}, settings)
    base = images.definition_hash(images.definition_dir(settings, plan.base))
    assert df_builder._digest(data, {"FLAVOUR": "mint"}, ctx_files, base) != config.hash
    (ctx.parent / "hello.txt").write_text("hello from the context\n")
    (ctx.parent / "debug.log").write_text("an ignored file changes nothing\n")
    plan, ctx_files, data = dockerfile.load(ctx, None, {"FLAVOUR": "mint"}, settings)
    assert df_builder._digest(data, {"FLAVOUR": "mint"}, ctx_files, base) == config.hash


async def test_build_dockerfile_is_callable_from_a_running_loop(
    built: tuple[Settings, images.ImageConfig],
) -> None:
    """Harbor's environment calls it from async code: a cache hit, there too."""
    settings, config = built
    ctx = Path(json.loads((config.rootfs.parent / "image.json").read_text())["dockerfile"]["path"])
    args = {"FLAVOUR": "mint"}
    again = dockerfile.build_dockerfile(ctx, name="df-session", build_args=args, settings=settings)
    assert again == config
    found = await dockerfile.abuild_dockerfile(
        ctx, name="df-session", build_args=args, settings=settings
    )
    assert found == config


@pytest.fixture
def session_settings(built: tuple[Settings, images.ImageConfig], tmp_path: Path) -> Settings:
    settings, _ = built
    session = Settings.load(
        state_dir=tmp_path / "state", cache_dir=settings.cache_dir, use_prefect=False
    )
    # the agent runtime is made from `default`: the shared build, linked, not built again here
    link_runtime_source(session)
    return session


@pytest.fixture
async def runtime(session_settings: Settings) -> AsyncIterator[Runtime]:
    async with runlevel.started(session_settings) as rt:
        yield rt


async def test_a_session_sees_the_files_env_cwd_and_user(
    http: httpx.AsyncClient, runtime: Runtime, member: Member, isolation: str
) -> None:
    h = member.headers
    r = await http.post(
        "/v1/sandboxes",
        json={"isolation": isolation, "image": "df-session", "timeout_seconds": 120},
        headers=h,
    )
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:

        async def run(body: dict[str, object]) -> dict[str, object]:
            r = await http.post(f"/v1/sandboxes/{sid}/exec", json=body, headers=h)
            assert r.status_code == 200, r.text
            return dict(r.json())

        res = await run(
            {
                "command": "id -un; pwd; echo $APP_MODE; mytool; cat /app/hello.txt; "
                "python3 -c 'import six; print(six.__name__)'; git --version | cut -c1-11; "
                "test ! -e /app/secret.txt && echo no-secret"
            }
        )
        assert res["exit_code"] == 0, res
        assert str(res["stdout"]).splitlines() == [
            "alice",
            "/app/work",
            "test mode",
            "tool says hi",
            "hello from the context",
            "six",
            "git version",
            "no-secret",
        ]
        named = await run({"command": "id -un; pwd", "user": "worker", "cwd": "/srv/data"})
        assert named["stdout"] == "worker\n/srv/data\n"
        root = await run({"command": ["id", "-u"], "user": "root"})
        assert root["stdout"] == "0\n"
        r = await http.get("/v1/images", headers=h)
        # and `default`: the agent runtime every sandbox mounts is made from it, in this cache
        assert [i["name"] for i in r.json()["images"]] == ["default", "df-session"]
    finally:
        r = await http.delete(f"/v1/sandboxes/{sid}", headers=h)
        assert r.status_code == 200, r.text
