"""Connection credentials at rest: sealed with Fernet under a key file in the state directory.

The operational store only ever holds the sealed token, so a copy of the database (a backup, a
``grep`` over the state dir) does not reveal a credential. The key file is created on first use
with mode 0600. Hosts that share one PostgreSQL store must share the same key file; losing it
makes every stored connection unreadable (re-add them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

from ephemeral import errors
from ephemeral.settings import Settings

KEY_FILE = "broker.key"


class Sealer:
    def __init__(self, key_path: Path) -> None:
        self.key_path = key_path
        self._fernet: Fernet | None = None

    @classmethod
    def for_settings(cls, settings: Settings) -> Sealer:
        return cls(settings.seal_key_path)  # EPHEMERAL_SEAL_KEY_FILE, else <state_dir>/broker.key

    def _key(self) -> Fernet:
        if self._fernet is None:
            self._fernet = Fernet(self._load_or_create())
        return self._fernet

    def _load_or_create(self) -> bytes:
        if not self.key_path.exists():
            self.key_path.parent.mkdir(parents=True, exist_ok=True)
            # Write a temp file, then link it into place: a concurrent first use either wins
            # the link or reads the winner's complete key, never a half-written one.
            tmp = self.key_path.with_name(f".{KEY_FILE}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(Fernet.generate_key() + b"\n")
            try:
                os.link(tmp, self.key_path)
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        key = self.key_path.read_bytes().strip()
        if not key:
            raise errors.EphemeralError(f"the broker key file {self.key_path} is empty")
        return key

    def fingerprint(self) -> str:
        """A one-way digest of the key, for processes to compare keys
        (ephemeral.cluster.sharing)."""
        import hashlib

        self._key()  # created on first use
        key = self.key_path.read_bytes().strip()
        return hashlib.sha256(b"ephemeral seal key fingerprint\0" + key).hexdigest()[:32]

    def seal(self, headers: dict[str, str]) -> str:
        return self._key().encrypt(json.dumps(headers).encode()).decode()

    def open(self, sealed: str) -> dict[str, str]:
        try:
            data = json.loads(self._key().decrypt(sealed.encode()))
        except (InvalidToken, ValueError) as exc:
            raise errors.EphemeralError(
                f"cannot decrypt a stored connection with {self.key_path}; "
                "was the key file replaced? re-add the connection"
            ) from exc
        if not isinstance(data, dict):
            raise errors.EphemeralError("a stored connection's credentials are malformed")
        return {str(k): str(v) for k, v in data.items()}
