"""A real OCI registry on loopback: Debian's ``docker-registry`` (the CNCF distribution
server) with TLS from ``trustme`` and htpasswd auth, images put in with ``skopeo``."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ephemeral.oci.credentials import Credential, CredentialStore
from ephemeral.settings import Settings
from tests.oci.layouts import Layout
from tests.oci.token_server import ISSUER, SERVICE, TokenServer
from tests.sandbox.image_cache import link_runtime_source

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
        deadline = time.monotonic() + 30
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
