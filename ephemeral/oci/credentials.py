"""Registry credentials at rest, sealed like connection credentials (``broker/secrets.py``).

``ephemeral images login HOST`` stores, per registry (``host[:port]`` as references spell
it), a username and password (sent as HTTP Basic to the registry or to its token service) or a
bearer token (sent as is). The file ``<state_dir>/registry-credentials.json`` (mode 0600)
holds only Fernet-sealed values under the same key file as connections; no credential is
ever logged, recorded or shown to a sandbox.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ephemeral import errors
from ephemeral.broker.secrets import Sealer
from ephemeral.oci.reference import DOCKER_HUB, LEGACY_DOCKER_HUB
from ephemeral.settings import Settings

FILE = "registry-credentials.json"


@dataclass(frozen=True)
class Credential:
    username: str | None = None
    password: str | None = None
    token: str | None = None

    def __repr__(self) -> str:  # never a secret in a traceback or a log line
        return f"Credential(username={self.username!r}, secret=<sealed>)"


def registry_key(host: str) -> str:
    return DOCKER_HUB if host in (LEGACY_DOCKER_HUB, "registry-1.docker.io") else host


class CredentialStore:
    def __init__(self, settings: Settings) -> None:
        self.path: Path = settings.state_dir / FILE
        self.sealer = Sealer.for_settings(settings)

    def _read(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise errors.EphemeralError(f"{self.path} is unreadable: {exc}") from exc
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _write(self, data: dict[str, str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{FILE}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)

    def set(self, host: str, cred: Credential) -> None:
        if not (cred.token or (cred.username and cred.password is not None)):
            raise errors.InvalidRequest.field(
                "--username", "give a username and password, or a token"
            )
        data = self._read()
        fields = {k: v for k, v in vars(cred).items() if v is not None}
        data[registry_key(host)] = self.sealer.seal(fields)
        self._write(data)

    def remove(self, host: str) -> bool:
        data = self._read()
        found = data.pop(registry_key(host), None) is not None
        if found:
            self._write(data)
        return found

    def hosts(self) -> list[str]:
        return sorted(self._read())

    def get(self, host: str) -> Credential | None:
        sealed = self._read().get(registry_key(host))
        if sealed is None:
            return None
        fields = self.sealer.open(sealed)
        return Credential(
            username=fields.get("username"),
            password=fields.get("password"),
            token=fields.get("token"),
        )
