"""The operational store (DESIGN §6, §7): SQLAlchemy Core on SQLite (default) or PostgreSQL."""

from ephemeral.store.models import ApiKey, Org, Principal, RunRow, Settlement
from ephemeral.store.store import Store

__all__ = ["ApiKey", "Org", "Principal", "RunRow", "Settlement", "Store"]
