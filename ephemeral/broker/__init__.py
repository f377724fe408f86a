"""The host-side egress broker: the `web_fetch` and `connection_call` model tools."""

from ephemeral.broker.broker import Broker
from ephemeral.broker.secrets import Sealer
from ephemeral.broker.tools import CONNECTION_CALL, WEB_FETCH

__all__ = ["CONNECTION_CALL", "WEB_FETCH", "Broker", "Sealer"]
