"""The driver parameter of the Harbor tests (skips with the reason where a driver is missing),
and the loopback OCI registry of tests/oci (TLS, htpasswd, skopeo-pushed layouts)."""

from __future__ import annotations

from tests.oci.conftest import registry
from tests.sessions.conftest import isolation

__all__ = ["isolation", "registry"]
