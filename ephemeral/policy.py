"""The permission manifest and the run request (DESIGN §1, §3).

Anything not granted here is unavailable in the run. The policy a run ran under is stored with
it and returned with it unchanged.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from typing import Annotated, NoReturn

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from ephemeral.labels import Labels
from ephemeral.oci.reference import check_image_value
from ephemeral.settings import Isolation

MAX_FILE_BYTES = 1 << 20  # 1 MiB per file
MAX_FILES_BYTES = 8 << 20  # 8 MiB in total
MAX_FILES = 64
MAX_PROMPT_CHARS = 100_000
MAX_COST_MICROS = 100_000_000  # $100 per run
MIN_DISK_MIB = 16  # a writable root's least (an ext4 smaller than this holds little)
MAX_STEP_COMMANDS = 32  # setup / verify commands per run
MAX_STEP_COMMAND_CHARS = 16_384
IMAGE_PATTERN = r"^[a-z0-9][a-z0-9-]{0,40}$"  # a built image's name
# a built image's name, or an OCI reference with Docker's rules (docs/images.md)
ImageName = Annotated[str, AfterValidator(check_image_value)]
MAX_GRANTED_MODELS = 16
MODEL_PATTERN = r"^[a-z0-9][a-z0-9_.-]*/[A-Za-z0-9_.:/-]+$"
ModelName = Annotated[str, Field(min_length=3, max_length=200, pattern=MODEL_PATTERN)]
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_HTTP_METHODS = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}


class _Strict(BaseModel):
    # strict: a JSON "yes", 1 or "30" is not a boolean or a number (no coercion); 422 instead.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FileSpec(_Strict):
    path: str = Field(min_length=1, max_length=255)
    content_base64: str

    @field_validator("path")
    @classmethod
    def _relative(cls, v: str) -> str:
        if _CONTROL.search(v):
            raise ValueError("must not contain NUL or control characters")
        if v.startswith("/"):
            raise ValueError("must be relative to the scratch directory")
        parts = v.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError("must not contain empty, '.' or '..' segments")
        return v

    @field_validator("content_base64")
    @classmethod
    def _b64(cls, v: str) -> str:
        try:
            data = base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("is not valid base64") from exc
        if len(data) > MAX_FILE_BYTES:
            raise ValueError(f"decodes to more than {MAX_FILE_BYTES} bytes")
        return v

    def data(self) -> bytes:
        return base64.b64decode(self.content_base64)


class Connection(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    methods: list[str] = Field(default_factory=lambda: ["GET"], min_length=1)
    paths: list[str] = Field(default_factory=lambda: ["/*"], min_length=1)

    @field_validator("methods")
    @classmethod
    def _methods(cls, v: list[str]) -> list[str]:
        bad = [m for m in v if m not in _HTTP_METHODS]
        if bad:
            raise ValueError(f"unknown HTTP method(s): {', '.join(bad)}")
        return v

    @field_validator("paths")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p.startswith("/") or _CONTROL.search(p):
                raise ValueError("each path must start with '/' and have no control characters")
        return v


def _command(v: str) -> str:
    if "\x00" in v:
        raise ValueError("must not contain NUL")
    if not v.strip():
        raise ValueError("must not be blank")
    return v


Command = Annotated[
    str, Field(min_length=1, max_length=MAX_STEP_COMMAND_CHARS), AfterValidator(_command)
]

_HOST_PATTERN = re.compile(
    r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
)
MAX_WEB_ALLOW = 256
_NUMBER_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")


def _ip_literal(host: str) -> bool:
    """Whether a URL parser or ``inet_aton`` reads ``host`` as an IP address: any IPv6 form,
    or a last label that is a number (decimal, octal or ``0x`` hex: ``2130706433``,
    ``0177.1``, ``0x7f.0.0.1``), as the WHATWG URL standard's "ends in a number" rule says."""
    inner = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(inner.split("%", 1)[0])
        return True
    except ValueError:
        pass
    if ":" in inner:
        return True  # no host name has a colon: some IPv6 spelling, or a port
    labels = inner.rstrip(".").split(".")
    return bool(_NUMBER_LABEL.match(labels[-1]))


class WebAllow(_Strict):
    """``web: {"allow": [...]}``: web on, but only to these host names. A pattern is a host
    name, or ``*.`` and a domain for its subdomains (never the domain itself); matching is
    anchored and case-insensitive. IP literals never match."""

    allow: list[str] = Field(min_length=1, max_length=MAX_WEB_ALLOW)

    @field_validator("allow")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        out = []
        for pattern in v:
            low = pattern.lower()
            bare = low.removeprefix("*.")
            if _ip_literal(bare):
                raise ValueError(f"{pattern!r} is an IP address; the allow list takes host names")
            if (
                len(low) > 253
                or not _HOST_PATTERN.match(low)
                or (low.startswith("*.") and "." not in bare)  # not a whole TLD
            ):
                raise ValueError(
                    f"{pattern!r} is not a host name or '*.' + a domain (e.g. '*.example.org')"
                )
            out.append(low)
        return out

    def allows(self, host: str) -> bool:
        name = host.lower().rstrip(".")
        for pattern in self.allow:
            if pattern.startswith("*."):
                if name.endswith(pattern[1:]) and len(name) > len(pattern) - 1:
                    return True
            elif name == pattern:
                return True
        return False


def _web_value(value: object) -> object:
    """``web`` is a JSON boolean or ``{"allow": [...]}``; every error names the field ``web``."""
    if isinstance(value, bool | WebAllow):
        return value
    if isinstance(value, dict):
        try:
            return WebAllow.model_validate(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "web"
            message = str(first["msg"]).removeprefix("Value error, ")
            raise PydanticCustomError(
                "value_error",
                'must be true, false or {"allow": [host patterns]}; {where}: {message}',
                {"where": where, "message": message},
            ) from None
    raise PydanticCustomError("bool_type", "Input should be a valid boolean")


MAX_AGENT_PATH_CHARS = 1_000


class AgentSpec(_Strict):
    """A program that is the run's agent instead of our loop (``agent:``, docs/recipes.md)."""

    # Run with ``sh -c`` as worker in the scratch directory (or the image's workdir), with the
    # prompt in $EPHEMERAL_PROMPT_FILE and the model gateway's variables.
    command: Command
    # The image it runs in (a built image, like ``image``); None: the run's ``image``.
    image: ImageName | None = None
    # A file the agent writes its final answer to (absolute, or relative to where the command
    # runs), read as worker once it exits; None: the answer is the command's stdout.
    output: str | None = Field(default=None, min_length=1, max_length=MAX_AGENT_PATH_CHARS)

    @field_validator("output")
    @classmethod
    def _output_path(cls, v: str | None) -> str | None:
        if v is not None and _CONTROL.search(v):
            raise ValueError("must not contain NUL or control characters")
        if v is not None and v.endswith("/"):
            raise ValueError("must name a file, not a directory")
        return v


class _Prompt(_Strict):
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = Field(default=None, pattern=MODEL_PATTERN)


class Policy(_Strict):
    web: Annotated[bool | WebAllow, BeforeValidator(_web_value)] = False
    shell: bool = True
    files: list[FileSpec] = Field(default_factory=list, max_length=MAX_FILES)
    connections: list[Connection] = Field(default_factory=list)
    zero_data_retention: bool = False
    timeout_seconds: int = Field(default=120, ge=1, le=3600)
    max_cost_micros: int = Field(default=40_000, ge=1, le=MAX_COST_MICROS)
    isolation: Isolation = "auto"
    # A built image by name (GET /v1/images) or an OCI reference (pulled at admission);
    # None: the server's default image.
    image: ImageName | None = None
    # The sandbox's writable root (its / and /tmp) in MiB, at most the host's disk_max_mib
    # (checked at admission); above disk_tmpfs_max_mib it is a file on the host's disk, not
    # memory (docs/images.md, "The root at run time"). None: the server's default.
    disk_mib: int | None = Field(default=None, ge=MIN_DISK_MIB, le=1 << 20)
    # Commands run as worker in the scratch directory: setup before the first model call (its
    # output never reaches the model), verify after the final answer, in a reserved slice of
    # timeout_seconds (verify_timeout_seconds; default a quarter of it, at most 60 s).
    setup: list[Command] = Field(default_factory=list, max_length=MAX_STEP_COMMANDS)
    verify: list[Command] = Field(default_factory=list, max_length=MAX_STEP_COMMANDS)
    verify_timeout_seconds: int | None = Field(default=None, ge=1, le=3600)
    # Put under /tmp/verify after the agent's processes are killed, before verify: the agent never
    # sees them (ephemeral.engine.verify). Paths relative to /tmp/verify; same limits as files.
    verify_files: list[FileSpec] = Field(default_factory=list, max_length=MAX_FILES)
    # Models code inside the sandbox may call through the gateway (http://model.internal/,
    # ephemeral.broker.gateway), metered against this budget. Checked at admission.
    models: list[ModelName] = Field(default_factory=list, max_length=MAX_GRANTED_MODELS)
    # A program of the run's own instead of our loop (ephemeral.agent.loop.AgentRun.agent_step): it
    # calls its model through the gateway, which grants it the run's model and ``models``.
    agent: AgentSpec | None = None

    @property
    def run_image(self) -> str | None:
        """The image the run's sandbox is made from: ``image``, else ``agent.image``."""
        return self.image or (self.agent.image if self.agent is not None else None)

    def granted_models(self, model: str | None) -> list[str]:
        """What the gateway serves: ``models``, and for an agent run the run's ``model`` too
        (the model it was asked to use; our loop's own calls do not go through the gateway)."""
        first = [model] if self.agent is not None and model else []
        return list(dict.fromkeys([*first, *self.models]))

    @model_validator(mode="after")
    def _agent_fits(self) -> Policy:
        if self.agent is None:
            return self
        if not self.shell:
            _fail(
                ("shell",),
                self.shell,
                "cannot be false with `agent`: an agent is a command run in the sandbox",
            )
        if self.agent.image and self.image and self.agent.image != self.image:
            _fail(
                ("agent", "image"),
                self.agent.image,
                f"differs from image ({self.image!r}): the run has one sandbox; give one of them",
            )
        return self

    def verify_reserve_seconds(self) -> int:
        """The slice of the time limit kept for verify (0 without verify commands)."""
        if not self.verify:
            return 0
        if self.verify_timeout_seconds is not None:
            return self.verify_timeout_seconds
        return max(1, min(60, self.timeout_seconds // 4))

    @model_validator(mode="after")
    def _verify_slice(self) -> Policy:
        if self.verify and self.verify_reserve_seconds() >= self.timeout_seconds:
            _fail(
                ("verify_timeout_seconds",),
                self.verify_timeout_seconds,
                f"must be less than timeout_seconds ({self.timeout_seconds}): the agent needs "
                "part of the time limit",
            )
        return self

    @property
    def web_on(self) -> bool:
        return self.web is not False

    @property
    def web_allow(self) -> list[str] | None:
        """The host patterns web is limited to, or None when it is not limited."""
        return list(self.web.allow) if isinstance(self.web, WebAllow) else None

    def web_shown(self) -> bool | dict[str, list[str]]:
        """``web`` as JSON (for events and pages)."""
        return self.web if isinstance(self.web, bool) else {"allow": list(self.web.allow)}

    @model_validator(mode="after")
    def _files_total(self) -> Policy:
        for name in ("files", "verify_files"):
            seen: dict[str, int] = {}
            total = 0
            for i, f in enumerate(getattr(self, name)):
                if f.path in seen:
                    also = f"{name}[{seen[f.path]}]"
                    _fail((name, i, "path"), f.path, f"duplicate path (also {also})")
                seen[f.path] = i
                total += len(f.content_base64) * 3 // 4
            if total > MAX_FILES_BYTES:
                _fail((name,), None, f"more than {MAX_FILES_BYTES} bytes in total")
        names: dict[str, int] = {}
        for i, c in enumerate(self.connections):
            if c.name in names:
                _fail(
                    ("connections", i, "name"),
                    c.name,
                    f"duplicate name (also connections[{names[c.name]}])",
                )
            names[c.name] = i
        return self


def _fail(loc: tuple[str | int, ...], value: object, message: str) -> NoReturn:
    # A ValidationError raised inside a validator keeps its location, so the API and the recipes
    # name the field itself (files[1].path), prefixed by wherever the policy sits.
    raise ValidationError.from_exception_data(
        "Policy",
        [InitErrorDetails(type=PydanticCustomError("value_error", message), loc=loc, input=value)],
    )


# The policy fields and their checks are Policy's own (inherited, never copied): a request is
# validated exactly like the policy it carries. _Prompt comes last so prompt and model lead.
class RunRequest(Policy, _Prompt):
    """The body of ``POST /v1/runs``: a prompt, an optional model, ``labels`` (a bounded string
    map for cost attribution, ``ephemeral.labels``) and the policy fields."""

    labels: Labels = Field(default_factory=dict)

    def policy(self) -> Policy:
        return Policy.model_validate(self.model_dump(include=set(Policy.model_fields)))
