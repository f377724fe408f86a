"""Image references with Docker's rules (distribution/reference's ``ParseNormalizedNamed``).

    reference  := name [ ":" tag ] [ "@" digest ]
    name       := [ domain "/" ] path          (at most 255 characters, domain included)
    domain     := host [ ":" port ]            host: DNS-like name, IPv4 or "[" IPv6 "]"
    path       := component ( "/" component )*   component: [a-z0-9]+ joined by . _ __ or -+
    tag        := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
    digest     := algorithm ":" hex            sha256 / sha384 / sha512, lowercase hex

The first ``/``-separated element is a registry domain only when it contains ``.`` or ``:``,
is ``localhost``, or is not lowercase (a path never is); otherwise the registry is Docker Hub
(``docker.io``, also spelled ``index.docker.io``), where a one-element path gets ``library/``
(``ubuntu`` is ``docker.io/library/ubuntu``). No tag and no digest means ``:latest``; with a
digest the tag is kept for display but the digest is what is pulled. A bare 64-hex name is
refused (Docker reads it as an image id).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ephemeral import errors

DOCKER_HUB = "docker.io"
LEGACY_DOCKER_HUB = "index.docker.io"
DEFAULT_TAG = "latest"
NAME_MAX = 255

_ALNUM = r"[a-z0-9]+"
_SEP = r"(?:[._]|__|-+)"
_COMPONENT = rf"{_ALNUM}(?:{_SEP}{_ALNUM})*"
_PATH = rf"{_COMPONENT}(?:/{_COMPONENT})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])"
_DOMAIN = rf"{_HOST}(?::[0-9]+)?"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_REFERENCE = re.compile(
    rf"(?P<domain>{_DOMAIN})/(?P<path>{_PATH})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?"
)
_IDENTIFIER = re.compile(r"[a-f0-9]{64}")
DIGEST_HEX = {"sha256": 64, "sha384": 96, "sha512": 128}


def check_digest(value: str, field: str = "digest") -> str:
    """``value`` if it is a digest this project can verify (sha256/384/512, lowercase hex of
    the algorithm's length, as go-digest's ``Validate``), else a 422 naming ``field``."""
    algorithm, sep, hexpart = value.partition(":")
    want = DIGEST_HEX.get(algorithm)
    if not sep or want is None:
        raise errors.InvalidRequest.field(
            field, f"{value[:100]!r} is not a digest (sha256:, sha384: or sha512: and hex)"
        )
    if len(hexpart) != want or not re.fullmatch(r"[0-9a-f]+", hexpart):
        raise errors.InvalidRequest.field(
            field, f"{value[:100]!r}: an {algorithm} digest is {want} lowercase hex characters"
        )
    return value


@dataclass(frozen=True)
class Reference:
    """A normalized reference: ``domain`` (``docker.io`` for Docker Hub), ``path``
    (``library/ubuntu``), ``tag`` (``latest`` when neither tag nor digest was given) and
    ``digest``."""

    domain: str
    path: str
    tag: str | None = None
    digest: str | None = None

    @property
    def name(self) -> str:
        return f"{self.domain}/{self.path}"

    @property
    def target(self) -> str:
        """What the registry is asked for: the digest when there is one, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    def __str__(self) -> str:
        out = self.name
        if self.tag is not None:
            out += f":{self.tag}"
        if self.digest is not None:
            out += f"@{self.digest}"
        return out

    def familiar(self) -> str:
        """Docker's short form (``ubuntu:24.04``, ``user/app``), for display."""
        name = self.name
        if self.domain == DOCKER_HUB:
            name = self.path.removeprefix("library/") if self.path.count("/") == 1 else self.path
        out = name
        if self.tag is not None:
            out += f":{self.tag}"
        if self.digest is not None:
            out += f"@{self.digest}"
        return out

    def with_digest(self, digest: str) -> Reference:
        return Reference(self.domain, self.path, self.tag, check_digest(digest))


def _split_domain(name: str) -> tuple[str, str]:
    first, slash, rest = name.partition("/")
    if not slash:
        return DOCKER_HUB, f"library/{name}"
    if first == "localhost" or any(c in first for c in ".:") or first.lower() != first:
        domain, remote = first, rest
    else:
        domain, remote = DOCKER_HUB, name
    if domain == LEGACY_DOCKER_HUB:
        domain = DOCKER_HUB
    if domain == DOCKER_HUB and "/" not in remote:
        remote = f"library/{remote}"
    return domain, remote


def parse(text: str, field: str = "image") -> Reference:
    """``text`` as Docker normalizes it, or a 422 naming ``field`` that says why not."""

    def bad(why: str) -> errors.InvalidRequest:
        return errors.InvalidRequest.field(
            field, f"{text[:300]!r} is not an image reference: {why}"
        )

    if not text or len(text) > 2048:
        raise bad("empty or too long")
    if _IDENTIFIER.fullmatch(text):
        raise bad("a 64-hex string is an image id, not a repository name")
    domain, remainder = _split_domain(text)
    remote = remainder.split("@", 1)[0].split(":", 1)[0]
    if remote.lower() != remote:
        raise bad(f"the repository name {remote!r} must be lowercase")
    m = _REFERENCE.fullmatch(f"{domain}/{remainder}")
    if m is None:
        raise bad("invalid reference format")
    if len(m["domain"]) + 1 + len(m["path"]) > NAME_MAX:
        raise bad(f"the repository name is longer than {NAME_MAX} characters")
    digest = m["digest"]
    if digest is not None:
        try:
            check_digest(digest, field)
        except errors.InvalidRequest as exc:
            raise bad(exc.detail.removeprefix(f"{field}: ")) from exc
    tag = m["tag"]
    if tag is None and digest is None:
        tag = DEFAULT_TAG
    return Reference(m["domain"], m["path"], tag, digest)


BUILT_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,40}")  # policy.IMAGE_PATTERN: a built image
MAX_IMAGE_CHARS = 1024


def is_reference(name: str) -> bool:
    """Whether an ``image`` value names a registry image: anything that is not a built
    image's name (``[a-z0-9][a-z0-9-]*``, at most 41 characters), which keeps its meaning.
    So a bare ``ubuntu`` is a built image's name; ``ubuntu:latest`` is pulled."""
    return BUILT_NAME.fullmatch(name) is None


def check_image_value(value: str) -> str:
    """The validator of ``image`` fields: a built image's name or a valid reference."""
    if len(value) > MAX_IMAGE_CHARS:
        raise ValueError(f"at most {MAX_IMAGE_CHARS} characters")
    if is_reference(value):
        try:
            parse(value)
        except errors.InvalidRequest as exc:
            raise ValueError(exc.detail.removeprefix("image: ")) from exc
    return value
