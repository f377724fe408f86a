"""A client of the OCI distribution protocol (``/v2/``), on httpx.

- **Where**: a reference's registry is reached at ``https://<domain>``; Docker Hub's API is
  ``registry-1.docker.io``; a registry with a mirror (``registry_mirrors``) only through it.
  Plain HTTP is tried after HTTPS fails only for loopback registries and those the operator
  lists (``registry_insecure``), as Docker does; TLS is always verified, against the system's
  CAs and ``registry_ca_file``.
- **SSRF**: a request names the registry, so every host the client talks to (registry, token
  realm, blob redirects) must resolve to public addresses only, unless the operator lists it
  in ``registry_private_hosts`` (the broker's address rules, ``broker/ssrf.py``), and the
  connection goes to the address checked. Credentials never follow a redirect to another
  host (httpx drops ``Authorization`` across origins).
- **Auth**: a ``401`` with ``WWW-Authenticate: Bearer realm=…,service=…,scope=…`` is answered
  by fetching a token from the realm (anonymously, or with the stored username and password
  as Basic), as Docker Hub and GHCR expect; ``Basic`` challenges get the stored credentials.
- **Bounds**: manifests and configs are read up to a fixed size; blobs are streamed to a file
  while their size and digest are checked, and refused past the size their descriptor gave.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import ipaddress
import os
import re
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from ephemeral import errors
from ephemeral.broker.ssrf import Refused, resolve
from ephemeral.oci import manifest as m
from ephemeral.oci.credentials import Credential, CredentialStore
from ephemeral.oci.reference import DOCKER_HUB, Reference
from ephemeral.settings import Settings

DOCKER_HUB_API = "registry-1.docker.io"
MAX_TOKEN_BYTES = 64 << 10
CHUNK = 1 << 20
_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _hash(digest: str) -> Any:
    return hashlib.new(digest.split(":", 1)[0])


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="…",service="…"`` → ("bearer", {realm, service, …})."""
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), {k.lower(): v for k, v in _CHALLENGE.findall(rest)}


class Registry:
    """One registry's client for one repository's pull (``async with Registry(...)``)."""

    def __init__(self, settings: Settings, ref: Reference) -> None:
        self.settings = settings
        self.ref = ref
        mirror = settings.registry_mirrors.get(ref.domain)
        if mirror:
            url = httpx.URL(mirror.rstrip("/"))
            self.bases = [str(url)]
            self.host = url.netloc.decode()
        else:
            host = DOCKER_HUB_API if ref.domain == DOCKER_HUB else ref.domain
            self.host = host
            self.bases = [f"https://{host}"]
            if self._may_use_http(host):
                self.bases.append(f"http://{host}")
        # a mirror's own credentials first (images login MIRROR-HOST), else the registry's
        creds = CredentialStore(settings)
        self.credential: Credential | None = (
            creds.get(self.host) if mirror else None
        ) or creds.get(ref.domain)
        self._auth: str | None = None
        self._client: httpx.AsyncClient | None = None

    def _may_use_http(self, netloc: str) -> bool:
        host = netloc.rsplit(":", 1)[0] if not netloc.endswith("]") else netloc
        return _is_loopback(host) or netloc in self.settings.registry_insecure

    def _private_ok(self, url: httpx.URL) -> bool:
        listed = self.settings.registry_private_hosts
        return url.host in listed or url.netloc.decode() in listed

    async def _check(self, request: httpx.Request) -> None:
        """Every request, redirects included: scheme and address rules. The request is then
        sent to the address that was checked (the name stays in ``Host`` and in TLS's SNI and
        certificate check), so a DNS answer cannot change between the check and the
        connection, as the broker does (``broker/outbound.py``)."""
        url = request.url
        if url.scheme == "http" and not self._may_use_http(url.netloc.decode()):
            raise Refused(f"plain http to {url.host!r} (not loopback nor in registry_insecure)")
        target = await resolve(url, allow_private=self._private_ok(url))
        if url.host != str(target.address):
            request.headers["Host"] = url.netloc.decode()
            if url.scheme == "https":
                request.extensions = {**request.extensions, "sni_hostname": url.host}
            request.url = target.dial_url

    async def __aenter__(self) -> Registry:
        ctx = ssl.create_default_context()
        if self.settings.registry_ca_file is not None:
            ctx.load_verify_locations(cafile=str(self.settings.registry_ca_file))
        self._client = httpx.AsyncClient(
            verify=ctx,
            trust_env=False,
            follow_redirects=True,
            max_redirects=5,
            timeout=httpx.Timeout(60.0, connect=20.0),
            event_hooks={"request": [self._check]},
            # identity: blobs are read raw and hashed as the registry stores them
            headers={"User-Agent": "ephemeral-oci/1", "Accept-Encoding": "identity"},
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.aclose()

    # ---- transport

    def _fail(self, what: str, exc: BaseException | str) -> errors.RegistryError:
        detail = exc.reason if isinstance(exc, Refused) else str(exc)
        return errors.RegistryError(f"{self.ref.familiar()}: {what}: {detail}"[:2000])

    @asynccontextmanager
    async def _get(self, path: str, accept: str | None = None) -> AsyncIterator[httpx.Response]:
        """A streamed GET of ``/v2/<path>``, authenticated on a 401 challenge, with HTTPS
        falling back to HTTP only where allowed."""
        resp = await self._open(path, accept)
        try:
            if resp.status_code != 200:
                raise self._fail(f"GET {path}", f"HTTP {resp.status_code}")
            yield resp
        except httpx.HTTPError as exc:
            raise self._fail(f"GET {path}", exc) from exc
        finally:
            await resp.aclose()

    async def _open(self, path: str, accept: str | None) -> httpx.Response:
        assert self._client is not None
        last: BaseException | None = None
        for base in list(self.bases):
            url = f"{base}/v2/{path}"
            try:
                for attempt in (1, 2):
                    headers = {"Accept": accept} if accept else {}
                    if self._auth:
                        headers["Authorization"] = self._auth
                    req = self._client.build_request("GET", url, headers=headers)
                    resp = await self._client.send(req, stream=True)
                    if resp.status_code == 401 and attempt == 1:
                        challenge = resp.headers.get("www-authenticate", "")
                        await resp.aclose()
                        await self._authenticate(challenge)
                        continue
                    self.bases = [base]  # what answered is used for the rest of the pull
                    return resp
            except (httpx.ConnectError, ssl.SSLError) as exc:
                last = exc
                continue
            except Refused as exc:
                raise self._fail("refused", exc) from exc
            except httpx.HTTPError as exc:
                raise self._fail(f"GET {path}", exc) from exc
        raise self._fail("cannot connect", last or "no endpoint")

    async def _authenticate(self, header: str) -> None:
        scheme, params = parse_challenge(header)
        cred = self.credential
        if scheme == "basic":
            if cred is None or cred.username is None:
                raise self._fail("authentication", "the registry wants credentials (images login)")
            raw = f"{cred.username}:{cred.password or ''}".encode()
            self._auth = "Basic " + base64.b64encode(raw).decode()
            return
        if scheme != "bearer" or "realm" not in params:
            raise self._fail("authentication", f"unsupported challenge {scheme!r}")
        if cred is not None and cred.token:
            self._auth = f"Bearer {cred.token}"
            return
        scope = params.get("scope") or f"repository:{self.ref.path}:pull"
        query = {"scope": scope}
        if "service" in params:
            query["service"] = params["service"]
        auth = None
        if cred is not None and cred.username:
            auth = httpx.BasicAuth(cred.username, cred.password or "")
        assert self._client is not None
        try:
            realm = httpx.URL(params["realm"])
            if realm.scheme not in ("https", "http"):
                raise self._fail("authentication", "the token realm is not an http(s) URL")
            resp = await self._client.get(realm, params=query, auth=auth)
        except Refused as exc:
            raise self._fail("token service refused", exc) from exc
        except httpx.HTTPError as exc:
            raise self._fail("token service", exc) from exc
        if resp.status_code != 200 or len(resp.content) > MAX_TOKEN_BYTES:
            raise self._fail("token service", f"HTTP {resp.status_code}")
        try:
            body = resp.json()
            token = body.get("token") or body.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_BYTES:
            raise self._fail("token service", "no token in its answer")
        self._auth = f"Bearer {token}"

    async def _read_bounded(self, path: str, accept: str | None, cap: int) -> tuple[bytes, str]:
        async with self._get(path, accept) as resp:
            length = resp.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > cap:
                raise m.bad(f"{path}: {length} bytes, over the limit of {cap}")
            body = bytearray()
            async for chunk in resp.aiter_raw():
                body += chunk
                if len(body) > cap:
                    raise m.bad(f"{path}: more than {cap} bytes")
            return bytes(body), resp.headers.get("content-type", "")

    # ---- the protocol

    async def manifest(self, target: str) -> tuple[bytes, dict[str, Any], str, str]:
        """``(body, document, media type, sha256 digest)`` of the manifest or index ``target``
        (a tag or a digest; by digest, the body must hash to it)."""
        body, ctype = await self._read_bounded(
            f"{self.ref.path}/manifests/{target}", m.ACCEPT, m.MAX_MANIFEST_BYTES
        )
        if ":" in target:
            h = _hash(target)
            h.update(body)
            if f"{target.split(':')[0]}:{h.hexdigest()}" != target:
                raise m.bad(f"the manifest {target} does not match its digest")
        doc = m.load_json(body, "manifest")
        return body, doc, m.media_type_of(doc, ctype), "sha256:" + hashlib.sha256(body).hexdigest()

    async def small_blob(self, d: m.Descriptor, cap: int) -> bytes:
        """A config: read whole (it is small and bounded), checked against its descriptor."""
        if d.size > cap:
            raise m.bad(f"blob {d.digest} is {d.size} bytes, over the limit of {cap}")
        body, _ = await self._read_bounded(f"{self.ref.path}/blobs/{d.digest}", None, d.size)
        _verify(d, body, len(body))
        return body

    async def blob_to_file(self, d: m.Descriptor, dest: Path) -> None:
        """Stream a blob to ``dest``, refusing a byte past its descriptor's size, and check its
        size and digest at the end; ``dest`` is removed if it does not verify."""
        h = _hash(d.digest)
        got = 0
        try:
            with dest.open("wb") as f:
                async with self._get(f"{self.ref.path}/blobs/{d.digest}") as resp:
                    async for chunk in resp.aiter_raw(CHUNK):
                        got += len(chunk)
                        if got > d.size:
                            raise m.bad(f"blob {d.digest} is longer than its {d.size} bytes")
                        h.update(chunk)
                        f.write(chunk)
            _verify(d, h, got)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dest)
            raise


def _verify(d: m.Descriptor, data: bytes | Any, size: int) -> None:
    if size != d.size:
        raise m.bad(f"blob {d.digest} is {size} bytes, its descriptor says {d.size}")
    if isinstance(data, bytes):
        h = _hash(d.digest)
        h.update(data)
    else:
        h = data
    if f"{d.digest.split(':')[0]}:{h.hexdigest()}" != d.digest:
        raise m.bad(f"blob {d.digest} does not match its digest")
