"""The one typed settings object, read once at the entry point and passed down.

No other module reads ``os.environ`` for configuration: the CLI, the API server and the flows
each call :func:`Settings.load` (or receive a ``Settings``) and hand it on.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, TypeAdapter, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

Isolation = Literal["auto", "microvm", "microvm-kvm", "microvm-tcg", "gvisor", "namespaces"]
ExecutorName = Literal["plain", "flow", "dispatch"]
# Old spellings of EPHEMERAL_EXECUTOR, still accepted (docs/architecture.md, "Executors").
OLD_EXECUTOR_NAMES = {"prefect": "dispatch", "local": None}  # local: flow, or plain (below)

REPO_ROOT = Path(__file__).resolve().parent.parent
# The shipped recipes and image definitions: a checkout has them at its top; an installed
# wheel carries them inside the package (pyproject.toml force-includes them as ``_data/``).
_BUNDLED = Path(__file__).resolve().parent / "_data"
DATA_ROOT = _BUNDLED if _BUNDLED.is_dir() else REPO_ROOT


_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_HOST_NAME = re.compile(rf"^({_LABEL}\.)*{_LABEL}$")
_NUMBER_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")  # URL parsers read it as an address


def _default_state_dir() -> Path:
    return Path.home() / ".local" / "state" / "ephemeral"


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "ephemeral"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EPHEMERAL_", extra="ignore", frozen=True)

    # client side
    url: str | None = None
    api_key: SecretStr | None = None

    # server side
    state_dir: Path = Field(default_factory=_default_state_dir)
    database_url: str | None = None
    cache_dir: Path = Field(default_factory=_default_cache_dir)  # rebuildable: images, templates
    default_model: str | None = Field(
        default=None,
        description="The model of a run that names none. Unset: a real model of the first "
        "provider with a key (ephemeral.models.PROVIDER_DEFAULTS), else none, and such a run "
        "is refused naming `model`. `replay/sandbox-proof` makes the product page's sample "
        "request run offline (a replay answers only the prompt it recorded).",
    )
    isolation: Isolation = "auto"
    price_book: Path | None = None
    image: str = "default"
    images_dir: Path = DATA_ROOT / "sandbox_images"
    recipes_dir: Path = DATA_ROOT / "recipes"
    cassettes_dir: Path = DATA_ROOT / "recipes" / "cassettes"
    runsc_path: Path | None = Field(
        default=None,
        description="The `runsc` binary the `gvisor` level runs and probes (absolute path); "
        "unset: `runsc` on `PATH`. For a newer gVisor than the distribution's (docs/gvisor.md).",
    )
    pool_size: int = Field(default=0, ge=0, le=64)
    disk_max_mib: int = Field(
        default=10240,
        ge=1,
        le=1 << 20,
        description="The largest writable root a run or session may ask for (`disk_mib`, a "
        "Harbor task's `storage_mb`); more is a 422 naming the field. Disk-backed layers are "
        "sparse files: the host's disk holds what sandboxes write.",
    )
    disk_tmpfs_max_mib: int = Field(
        default=256,
        ge=0,
        le=1 << 20,
        description="The largest writable root kept in memory (a tmpfs charged to the "
        "sandbox's memory limit); a larger `disk_mib` is an ext4 file on the host's disk under "
        '`<state_dir>/run`, not charged to memory (docs/images.md, "The root at run time").',
    )
    max_concurrent_runs: int = Field(default=8, ge=1, le=512)
    # Runs admitted beyond the slots wait, holding only their reservation; past this many
    # waiting, POST /v1/runs answers 429 with Retry-After and reserves nothing.
    max_queued_runs: int = Field(default=64, ge=0, le=100_000)
    retention_days: int = Field(default=30, ge=1)
    max_turns: int = Field(default=20, ge=1, le=200)
    use_prefect: bool | None = Field(
        default=None,
        description="Old spelling, still accepted: `false` is `EPHEMERAL_EXECUTOR=plain`, "
        "`true` is `flow`; ignored under `dispatch`. Nothing reads it but the executor setting.",
    )
    host: str = "127.0.0.1"
    port: int = 8000
    namespaces_privileged: bool = Field(
        default=False,
        description="Run the `namespaces` sandbox without a user namespace: its agent is host "
        "root (capabilities cut to a few) and commands run as host uid 1000. Only for kernels "
        "that refuse user namespaces; labelled `namespaces-privileged`. Never chosen "
        "automatically.",
    )
    broker_allow_private_hosts: bool = Field(
        default=False,
        description="Let `web_fetch` and connections reach loopback and private addresses "
        "(link-local/metadata stays refused). For tests and internal APIs; unsafe in production.",
    )
    egress_allow_private: list[str] = Field(
        default_factory=list,
        description="Host names and IP networks (JSON list: `mirror.internal`, "
        "`10.20.0.0/16`, `127.0.0.1/32`) that web traffic of runs and sessions with `web` "
        "granted may reach although they resolve to loopback, private or any other "
        "special-purpose address (an internal package mirror or proxy). A listed name passes "
        "whatever it resolves to; nothing unlisted does. A run's `web` allow list still "
        "applies; connections and runs without `web` are unaffected.",
    )
    egress_port: int = Field(
        default=3128,
        ge=1024,
        le=65535,
        description="The port of the egress forwarder on 127.0.0.1 inside a sandbox whose run "
        "has `web` or connections (the commands' `http_proxy`).",
    )
    egress_max_streams: int = Field(
        default=16,
        ge=1,
        le=256,
        description="Connections through the egress proxy open at once per run; more are "
        "refused inside the sandbox.",
    )
    egress_max_bytes: int = Field(
        default=1 << 30,
        ge=1024,
        description="Bytes (both ways) one run may move through the egress proxy; past it, "
        "streams are cut and new ones refused.",
    )
    egress_idle_seconds: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="An egress stream with no bytes either way for this long is closed.",
    )

    # registry images (docs/images.md, "Registry images")
    registry_mirrors: dict[str, str] = Field(
        default_factory=dict,
        description='Pull-through mirrors, JSON `{"docker.io": "https://mirror.internal:5000"}`: '
        "a registry listed here is reached only through its mirror (same repository paths), "
        "never directly, so an air-gapped site names its internal mirror once.",
    )
    registry_insecure: list[str] = Field(
        default_factory=list,
        description="Registries (`host[:port]`, JSON list) that may be reached over plain HTTP "
        "after HTTPS fails, as Docker's `insecure-registries`; loopback registries always may. "
        "TLS, when used, is always verified.",
    )
    registry_private_hosts: list[str] = Field(
        default_factory=list,
        description="Registries, token services and blob hosts (`host` or `host:port`, JSON "
        "list) that may resolve to loopback or private addresses; any other must resolve to "
        "public ones only (the broker's SSRF rule), since a request names the registry.",
    )
    registry_ca_file: Path | None = Field(
        default=None,
        description="A PEM bundle of CA certificates trusted for registries, beside the "
        "system's (a private registry's own CA).",
    )
    image_max_unpacked_mib: int = Field(
        default=16384,
        ge=1,
        description="Bytes (MiB) one pulled image may unpack to across its layers; a layer "
        "that decompresses past it is a decompression bomb and the pull fails.",
    )
    image_max_files: int = Field(
        default=1_000_000,
        ge=1,
        description="Entries (files, directories, links) one pulled image may unpack.",
    )
    image_max_layer_mib: int = Field(
        default=8192,
        ge=1,
        description="The largest compressed layer (MiB) a pull downloads.",
    )
    build_memory_mib: int = Field(
        default=2048,
        ge=64,
        le=1 << 20,
        description="Memory of one image build (its cgroup: every step, the host's pip and "
        "mmdebstrap, each step's /tmp); past it the build fails saying so.",
    )
    build_pids: int = Field(
        default=1024,
        ge=64,
        le=1 << 16,
        description="Processes one image build may run at once (its cgroup).",
    )
    build_cpus: float = Field(
        default=2.0, gt=0, le=64, description="CPUs one image build may use (its cgroup)."
    )
    build_disk_mib: int = Field(
        default=8192,
        ge=256,
        le=1 << 22,
        description="The filesystem one image build writes in (an ext4 file of this size, "
        "base layer included): a write past it is ENOSPC and fails the build.",
    )
    build_tmp_mib: int = Field(
        default=512,
        ge=16,
        le=1 << 20,
        description="The `/tmp` (and `/run`) of each build step: a tmpfs of this size, "
        "charged to the build's memory.",
    )
    build_add_max_mib: int = Field(
        default=2048,
        ge=1,
        le=1 << 22,
        description="What one `ADD` of a local archive may unpack (the sum of its members' "
        "sizes, read before anything is unpacked).",
    )
    build_add_max_files: int = Field(
        default=100_000,
        ge=1,
        le=10_000_000,
        description="Members one `ADD` of a local archive may unpack.",
    )
    build_allow_hosts: list[str] = Field(
        default_factory=list,
        description="Hosts a Dockerfile build's `RUN` may reach, through the build's proxy "
        "(JSON list of host names and `*.` + a domain, as a run's `web` allow list; IP "
        "literals never match). Each request is recorded beside the image. Empty: builds have "
        "no network (the default).",
    )
    image_cache_max_mib: int = Field(
        default=20480,
        ge=0,
        description="Size of the image cache (builds, base layers, pulled images' layers) kept "
        "after each build: "
        "the least recently used builds and layers no live sandbox or pool uses are removed "
        "past it (`ephemeral images gc`); 0 keeps everything.",
    )

    prebuild_workers: int = Field(
        default=0,
        ge=0,
        le=16,
        description="Environments `ephemeral images prebuild` pulls or builds at once "
        "(`--jobs` overrides it); 0: the host's cores.",
    )

    # providers: keys never leave the host process
    openai_api_key: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("OPENAI_API_KEY", "EPHEMERAL_OPENAI_API_KEY")
    )
    openrouter_api_key: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("OPENROUTER_API_KEY", "EPHEMERAL_OPENROUTER_API_KEY"),
    )
    anthropic_api_key: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("ANTHROPIC_API_KEY", "EPHEMERAL_ANTHROPIC_API_KEY"),
    )
    openai_base_url: str = "https://api.openai.com/v1"
    openrouter_base_url: str = "https://openrouter.ai/api/v1"
    anthropic_base_url: str = "https://api.anthropic.com"

    prefect_database_url: SecretStr | None = Field(
        default=None,
        description="PostgreSQL (`postgresql+asyncpg://…`) for the Prefect server that "
        "`ephemeral serve`/`run` start themselves (no `PREFECT_API_URL`), instead of SQLite in "
        "the state dir: flow-run writes then no longer queue behind SQLite's one writer. The "
        "first start migrates an empty database (minutes).",
    )

    # scale-out (docs/deploy.md): where runs execute and how hosts share them
    executor: ExecutorName = Field(
        default="flow",
        description="How a run executes. `plain`: its steps in this process, no Prefect. "
        "`flow`: an `agent-run` Prefect flow run in this process, a task per step. `dispatch`: "
        "`ephemeral serve` admits runs and hands each to a Prefect task worker (`ephemeral "
        "worker`), and places each sandbox session on a worker host, so the API process starts "
        "no sandbox at all; `ephemeral run`/`eval` dispatch their runs the same way. Old "
        "spellings, still accepted: `local` (`flow`, or `plain` with `EPHEMERAL_USE_PREFECT=0`) "
        "and `prefect` (`dispatch`).",
    )
    host_id: str = Field(
        default_factory=socket.gethostname,
        pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$",
        description="This host's name on runs, events and records (default: the hostname). "
        "Several workers on one machine with their own state dirs simulate several hosts.",
    )
    lease_seconds: float = Field(
        default=30.0,
        ge=1.0,
        le=3600.0,
        description="The lease a worker holds on each run it executes, renewed every third of it; "
        "a run whose lease expired (its host died) is settled `failed`/`infra_error` by any live "
        "worker or API process.",
    )
    drain_seconds: float = Field(
        default=60.0,
        ge=0.0,
        le=86_400.0,
        description="How long a draining worker (SIGTERM, `ephemeral worker --drain`) lets its "
        "running runs finish before it ends the rest `cancelled` (settled at once, sandboxes "
        "destroyed); runs it has taken but not started go back to the queue at once.",
    )
    link_address: str = Field(
        default="127.0.0.1",
        description="The IP address a worker's internal session channel listens on (API "
        "processes reach the sessions it hosts there). Loopback or a private address only: a "
        "public or wildcard address is refused at start.",
    )
    link_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="The internal channel's TCP port; 0 takes a free one (the worker registers "
        "its address in the store's host directory).",
    )
    link_max_connections: int = Field(
        default=1024,
        ge=16,
        le=65_536,
        description="Connections a worker's internal channel holds open at once. Past it, a new "
        "connection takes the place of the oldest one that has not yet sent an authentic "
        "request; when every one has, the new one is reset as it is accepted.",
    )
    link_max_unauthenticated_per_peer: int = Field(
        default=128,
        ge=1,
        le=65_536,
        description="Connections from one address that have not yet sent an authentic request "
        "on the internal channel; past it, that address's oldest such connection is closed for "
        "the new one (one address never pushes out another's).",
    )
    link_auth_seconds: float = Field(
        default=5.0,
        gt=0,
        le=60,
        description="A connection to the internal channel whose first authentic request has not "
        "arrived within this is closed.",
    )
    host_sessions: int = Field(
        default=32,
        ge=0,
        le=512,
        description="Sandbox sessions one worker hosts at once (`ephemeral worker --sessions`), "
        "beside its runs; 0: it takes none.",
    )
    placement_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        le=600,
        description="How long an API process tries to place a new sandbox session on a worker "
        "host (all full or unreachable) before the session ends `failed`, refunded.",
    )
    zdr_ttl_seconds: int = Field(
        default=900,
        ge=10,
        le=86_400,
        description="How long a zero-data-retention prompt or output may wait, sealed in the "
        "store, for its one reader before it is deleted unread.",
    )
    records_root: Path | None = Field(
        default=None,
        validation_alias=AliasChoices("EPHEMERAL_RECORDS_DIR", "records_root"),
        description="The records root (`EPHEMERAL_RECORDS_DIR`), possibly shared by many hosts: "
        "each writes its own `host=` partition. Default: `<state_dir>/records`.",
    )
    seal_key_file: Path | None = Field(
        default=None,
        description="The Fernet key sealing connection credentials and zero-data-retention "
        "content in the store. Hosts that share one store share it. Default: "
        "`<state_dir>/broker.key`.",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_executor_spellings(cls, data: Any) -> Any:
        """``executor: local|prefect`` and ``use_prefect`` as they were, mapped to the names."""
        if not isinstance(data, dict):
            return data
        executor = data.get("executor")
        if isinstance(executor, str) and executor in OLD_EXECUTOR_NAMES:
            executor = OLD_EXECUTOR_NAMES[executor]
        use = data.get("use_prefect")
        if use is not None and executor != "dispatch":
            flow = TypeAdapter(bool).validate_python(use)
            if not flow:
                executor = "plain"
            elif executor is None:
                executor = "flow"
        if executor is None:
            return {k: v for k, v in data.items() if k != "executor"}
        return {**data, "executor": executor}

    @field_validator("state_dir", "cache_dir", "images_dir", "recipes_dir", "cassettes_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @field_validator("records_root", "seal_key_file", "registry_ca_file")
    @classmethod
    def _absolute_if_set(cls, v: Path | None) -> Path | None:
        # shared paths: the same on every host, never relative to a working directory
        return None if v is None else v.expanduser().resolve()

    @field_validator("egress_allow_private")
    @classmethod
    def _private_entries(cls, v: list[str]) -> list[str]:
        out = []
        for entry in v:
            text = entry.strip().lower().rstrip(".")
            try:  # strict: host bits set (10.0.0.1/8) is a mistake, not a network
                out.append(str(ipaddress.ip_network(text)))
                continue
            except ValueError as exc:
                if "/" in text or ":" in text:
                    raise ValueError(f"{entry!r} is not an IP network: {exc}") from None
            # a host name's last label is never a number (0x7f.1 and 10.1 are addresses)
            last = text.rsplit(".", 1)[-1]
            if len(text) > 253 or not _HOST_NAME.match(text) or _NUMBER_LABEL.match(last):
                raise ValueError(f"{entry!r} is neither a host name nor an IP network (CIDR)")
            out.append(text)
        return out

    @field_validator("build_allow_hosts")
    @classmethod
    def _build_hosts(cls, v: list[str]) -> list[str]:
        out = []  # the patterns of a run's web allow list (policy.WebAllow matches them)
        for entry in v:
            text = entry.strip().lower()
            bare = text.removeprefix("*.")
            last = bare.rsplit(".", 1)[-1]
            if (
                len(bare) > 253
                or not _HOST_NAME.match(bare)
                or _NUMBER_LABEL.match(last)
                or (text.startswith("*.") and "." not in bare)
            ):
                raise ValueError(
                    f"{entry!r} is not a host name or '*.' + a domain (IP literals never match)"
                )
            out.append(text)
        return out

    @field_validator("runsc_path")
    @classmethod
    def _runsc_absolute(cls, v: Path | None) -> Path | None:
        # a relative path would depend on the server's working directory
        if v is not None and not v.is_absolute():
            raise ValueError("must be an absolute path")
        return v

    @classmethod
    def load(cls, **overrides: object) -> Settings:
        return cls(**overrides)  # type: ignore[arg-type]

    # derived paths: one place decides the layout of the state directory
    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{self.state_dir / 'ephemeral.db'}"

    @property
    def records_dir(self) -> Path:
        return self.records_root or self.state_dir / "records"

    @property
    def seal_key_path(self) -> Path:
        return self.seal_key_file or self.state_dir / "broker.key"

    @property
    def image_cache_dir(self) -> Path:
        """Built images, keyed by the hash of their definition; shared by every state dir."""
        return self.cache_dir / "images"

    @property
    def oci_dir(self) -> Path:
        """The layer store of pulled images (``ephemeral/oci/store.py``)."""
        return self.cache_dir / "oci"

    @property
    def sandboxes_dir(self) -> Path:
        """Persisted sandbox handles; the reaper reads them after a crash."""
        return self.state_dir / "sandboxes"

    @property
    def prefect_home(self) -> Path:
        return self.state_dir / "prefect"
