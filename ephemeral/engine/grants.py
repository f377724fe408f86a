"""The grant check that runs and sandbox sessions share at admission: what a policy grants
(models, connections, disk) must exist on this host and in the org."""

from __future__ import annotations

from ephemeral import errors
from ephemeral.money.pricing import PriceBook
from ephemeral.policy import Policy
from ephemeral.settings import Settings
from ephemeral.store import Store


async def require_grants(
    store: Store, org_id: str, policy: Policy, price_book: PriceBook, settings: Settings
) -> None:
    """A 422 naming ``connections[i].name`` when the org has no connection of that name,
    ``models[i]`` for a granted model this host cannot serve or price, or ``disk_mib`` past
    the host's ``disk_max_mib`` (runs and sandbox sessions are admitted with the same check)."""
    from ephemeral.broker.gateway import check_grants

    check_grants(policy.models, price_book, settings)
    if policy.disk_mib is not None and policy.disk_mib > settings.disk_max_mib:
        raise errors.InvalidRequest.field(
            "disk_mib",
            f"must be at most {settings.disk_max_mib} (this host's EPHEMERAL_DISK_MAX_MIB)",
        )
    names = [c.name for c in policy.connections]
    missing = await store.connections.missing(org_id, names)
    if missing:
        raise errors.InvalidRequest.field(
            f"connections[{names.index(missing[0])}].name",
            f"this org has no connection named {missing[0]!r} (ephemeral connections add)",
        )
