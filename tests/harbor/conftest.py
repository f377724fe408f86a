"""The driver parameter of the Harbor tests (skips with the reason where a driver is missing)."""

from __future__ import annotations

from tests.sessions.conftest import isolation

__all__ = ["isolation"]
