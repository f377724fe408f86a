"""Member API keys: ``eph_`` + 256 random bits, shown once, stored as SHA-256.

A plain SHA-256 is enough here (no salt, no slow hash): the secret is 256 random bits, so
there is nothing to brute-force, and a fast hash keeps authentication off the hot path.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "eph_"
PREFIX_CHARS = 12  # "eph_" + 8 characters: shown in listings, used to find the candidate row
MAX_KEY_CHARS = 200


def generate() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def digest(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def prefix(plaintext: str) -> str:
    return plaintext[:PREFIX_CHARS]


def well_formed(plaintext: object) -> bool:
    return (
        isinstance(plaintext, str)
        and plaintext.startswith(KEY_PREFIX)
        and PREFIX_CHARS < len(plaintext) <= MAX_KEY_CHARS
        and plaintext.isascii()
    )


def matches(stored_digest: str, plaintext: str) -> bool:
    return hmac.compare_digest(stored_digest, digest(plaintext))
