"""A real OCI registry on loopback: Debian's ``docker-registry`` (the CNCF distribution
server) with TLS from ``trustme`` and htpasswd auth, images put in with ``skopeo``."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ephemeral.oci.credentials import Credential, CredentialStore
from ephemeral.settings import Settings
from tests.oci.layouts import Layout
from tests.oci.token_server import ISSUER, SERVICE, TokenServer
from tests.patience import PATIENCE
from tests.sandbox.image_cache import link_runtime_source

if TYPE_CHECKING:
    import httpx

    from ephemeral.engine.runtime import Runtime

USER, PASSWORD = "tester", "s3cret-pass"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bcrypt(password: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

        return crypt.crypt(
            password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16)
        )  # cost 4: checked per request


@dataclass
class Registry:
    host: str  # 127.0.0.1:PORT
    root: Path  # the registry's storage
    ca_file: Path
    cert_dir: Path  # for skopeo: the CA as ca.crt
    tls: bool = True

    def push(self, layout: Path, tag: str, repo_tag: str, *, all_images: bool = False) -> None:
        argv = ["skopeo", "copy", "--quiet", "--preserve-digests"]
        if self.tls:
            argv += ["--dest-creds", f"{USER}:{PASSWORD}", "--dest-cert-dir", str(self.cert_dir)]
        else:
            argv.append("--dest-tls-verify=false")
        if all_images:
            argv.append("--all")
        argv += [f"oci:{layout}:{tag}", f"docker://{self.host}/{repo_tag}"]
        subprocess.run(argv, check=True, capture_output=True, timeout=300)

    def push_image(self, tmp: Path, repo_tag: str, layers: list[bytes], **kw: object) -> str:
        """Make a one-image layout and push it; returns the manifest's digest."""
        layout = Layout(tmp / f"layout-{repo_tag.replace('/', '_').replace(':', '_')}")
        desc = layout.image(layers, **kw)  # type: ignore[arg-type]
        layout.tag(desc, "t")
        layout.close()
        self.push(layout.root, "t", repo_tag)
        return str(desc["digest"])

    def blob_file(self, digest: str) -> Path:
        hexd = digest.split(":")[1]
        return self.root / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


@contextlib.contextmanager
def serve_registry(
    base: Path, *, tls: bool = True, token_realm: str | None = None, ca: Any = None
) -> Iterator[Registry]:
    """A ``docker-registry`` on 127.0.0.1 storing under ``base``: with TLS from a trustme CA
    and htpasswd auth (``USER``/``PASSWORD``), or token auth against ``token_realm`` (the CA's
    certificates sign the tokens), or (``tls=False``, for the benchmark) plain HTTP with no
    auth."""
    import trustme

    ca = ca or trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost", "registry.test")
    cert.private_key_and_cert_chain_pem.write_to_path(str(base / "server.pem"))
    cert.private_key_pem.write_to_path(str(base / "server.key"))
    ca.cert_pem.write_to_path(str(base / "ca.pem"))
    (base / "certs").mkdir(exist_ok=True)
    ca.cert_pem.write_to_path(str(base / "certs" / "ca.crt"))
    (base / "htpasswd").write_text(f"{USER}:{_bcrypt(PASSWORD)}\n")
    port = _free_port()
    auth = (
        f"  token: {{realm: {token_realm}, service: {SERVICE}, issuer: {ISSUER}, "
        f"rootcertbundle: {base / 'ca.pem'}}}"
        if token_realm
        else f"  htpasswd: {{realm: test-registry, path: {base / 'htpasswd'}}}"
    )
    secure = (
        f"""  tls: {{certificate: {base / "server.pem"}, key: {base / "server.key"}}}
auth:
{auth}
"""
        if tls
        else ""
    )
    (base / "config.yml").write_text(
        f"""version: 0.1
log: {{level: warn}}
storage:
  filesystem: {{rootdirectory: {base / "data"}}}
  delete: {{enabled: true}}
http:
  addr: 127.0.0.1:{port}
{secure}"""
    )
    log = (base / "registry.log").open("wb")
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(base / "config.yml")], stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + PATIENCE
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"docker-registry did not start: {(base / 'registry.log').read_text()}"
                )
            time.sleep(0.05)
        yield Registry(f"127.0.0.1:{port}", base / "data", base / "ca.pem", base / "certs", tls)
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    for binary in ("docker-registry", "skopeo"):
        if shutil.which(binary) is None:
            pytest.skip(f"{binary} not installed (make apt installs it)")
    with serve_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="session")
def token_registry(
    tmp_path_factory: pytest.TempPathFactory, registry: Registry
) -> Iterator[tuple[Registry, TokenServer]]:
    """A second registry whose auth is bearer tokens from a token service, as Docker Hub and
    GHCR do (anonymous tokens for anyone)."""
    import trustme

    ca = trustme.CA()
    signer = ca.issue_cert("token-signer")
    with TokenServer(signer.private_key_pem.bytes(), signer.cert_chain_pems[0].bytes()) as tokens:
        base = tmp_path_factory.mktemp("token-registry")
        with serve_registry(base, token_realm=tokens.realm, ca=ca) as reg:
            yield reg, tokens


@pytest.fixture
def oci_settings(tmp_path: Path, registry: Registry) -> Settings:
    """Settings of a host that trusts the test CA, may reach the loopback registry, and has
    its credentials stored (sealed)."""
    settings = Settings.load(
        state_dir=tmp_path / "state",
        cache_dir=tmp_path / "cache",
        registry_ca_file=registry.ca_file,
        registry_private_hosts=[registry.host],
    )
    CredentialStore(settings).set(registry.host, Credential(username=USER, password=PASSWORD))
    link_runtime_source(settings)  # the agent runtime's python, not rebuilt in this cache
    return settings


@dataclass
class RunSeen:
    """A run that succeeded, as the API shows it."""

    row: dict[str, Any]  # GET /v1/runs/{id}
    events: list[Any]
    pulled_hex: str  # the digest the layer store now holds for the run's image

    def first(self, kind: str) -> dict[str, Any]:
        """The data of the run's first event of type ``kind``."""
        data: dict[str, Any] = next(e["data"] for e in self.events if e["type"] == kind)
        return data


@dataclass
class MemberApi:
    """The real app in process (httpx's ASGI transport) on a runtime, as one org's member."""

    rt: Runtime
    http: httpx.AsyncClient
    headers: dict[str, str]

    @staticmethod
    def run_body(image: str, isolation: str, timeout_seconds: int) -> dict[str, Any]:
        return {
            "prompt": "go",
            "image": image,
            "isolation": isolation,
            "timeout_seconds": timeout_seconds,
            "max_cost_micros": 40_000,
        }

    async def run(self, image: str, isolation: str, timeout_seconds: int) -> RunSeen:
        """``POST /v1/runs``, waited for; it must have succeeded, its image pulled."""
        from ephemeral.oci.reference import parse
        from ephemeral.oci.store import LayerStore

        body = self.run_body(image, isolation, timeout_seconds)
        r = await self.http.post("/v1/runs", json=body, headers=self.headers)
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        await self.rt.wait(run_id, timeout_seconds * 2.5)
        got = (await self.http.get(f"/v1/runs/{run_id}", headers=self.headers)).json()
        events = (await self.http.get(f"/v1/runs/{run_id}/events", headers=self.headers)).json()
        pulled = LayerStore(self.rt.settings).resolve(parse(image))
        assert pulled is not None
        assert got["status"] == "succeeded", got["termination"]
        return RunSeen(got, events, pulled.hex)

    async def session_exec(
        self, image: str, isolation: str, timeout_seconds: int, command: str
    ) -> dict[str, Any]:
        """``POST /v1/sandboxes``, one exec in it, then cancelled: the exec's answer."""
        body = {
            "isolation": isolation,
            "image": image,
            "timeout_seconds": timeout_seconds,
            "max_cost_micros": 50_000,
        }
        r = await self.http.post("/v1/sandboxes", json=body, headers=self.headers)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            r = await self.http.post(
                f"/v1/sandboxes/{sid}/exec", json={"command": command}, headers=self.headers
            )
            answer: dict[str, Any] = r.json()
            return answer
        finally:
            await self.http.post(f"/v1/sandboxes/{sid}/cancel", headers=self.headers)


@pytest.fixture
def member_api(
    tmp_path: Path,
) -> Callable[[Settings, str], AbstractAsyncContextManager[MemberApi]]:
    """``member_api(settings, commands)``: the API on a runtime of ``settings`` whose default
    model (a cassette) runs ``commands`` in one shell call and then ends, and one member."""

    @contextlib.asynccontextmanager
    async def start(settings: Settings, commands: str) -> AsyncIterator[MemberApi]:
        import httpx

        from ephemeral.api import create_app
        from tests import runlevel
        from tests.api.conftest import new_member, write_cassette
        from tests.run.conftest import turn

        cassettes = tmp_path / "cassettes"
        cassettes.mkdir()
        model = write_cassette(cassettes, "oci-run", [turn(commands), turn(final="ok")])
        settings = settings.model_copy(update={"cassettes_dir": cassettes, "default_model": model})
        async with runlevel.started(settings) as rt:
            member = await new_member(rt, "acme")
            transport = httpx.ASGITransport(app=create_app(rt.settings, rt))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                yield MemberApi(rt, http, member.headers)

    return start
