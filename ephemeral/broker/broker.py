"""The host-side broker of one run: serves ``web_fetch`` and ``connection_call`` to the model.

The sandbox has no network at all; whatever the agent may reach outside, it reaches through
these tools, made by the host under the run's policy and budget. The broker sees the run only
through a :class:`~ephemeral.broker.context.BrokerContext` (policy, events, charge, time left,
connection lookup), never the whole run. Credentials live here and in
the store (sealed); they never enter the sandbox, an event, a log or a tool result.
"""

from __future__ import annotations

from ephemeral.broker import connections, web
from ephemeral.broker.context import BrokerContext
from ephemeral.broker.egress import Egress
from ephemeral.broker.secrets import Sealer
from ephemeral.broker.ssrf import PrivateAllow, public_url
from ephemeral.broker.tools import CONNECTION_CALL, NAMES, WEB_FETCH, tools_for
from ephemeral.policy import Policy
from ephemeral.providers.base import ToolCall, ToolSpec
from ephemeral.settings import Settings


class Broker:
    """One per run (it numbers the run's web charges)."""

    def __init__(self, settings: Settings, sealer: Sealer | None = None) -> None:
        self.allow_private = settings.broker_allow_private_hosts
        # web only (the proxy's web requests and web_fetch), never connections
        self.web_private = PrivateAllow.of(settings.egress_allow_private)
        self.sealer = sealer or Sealer.for_settings(settings)
        self._web_requests = 0
        self.settings = settings

    def wants_egress(self, policy: Policy) -> bool:
        """Whether a run gets the egress proxy in its sandbox: only with web, connections or
        models (the gateway) granted."""
        return policy.web_on or bool(policy.connections) or bool(policy.models)

    def egress(self, ctx: BrokerContext, *, request_micros: int, mib_micros: int) -> Egress:
        """The run's egress proxy (``ephemeral.broker.egress``), charging through ``ctx``."""
        return Egress(
            ctx,
            next_seq=self._next_seq,
            request_micros=request_micros,
            sealer=self.sealer,
            allow_private=self.allow_private,
            web_private=self.web_private,
            max_bytes=self.settings.egress_max_bytes,
            idle_seconds=self.settings.egress_idle_seconds,
            mib_micros=mib_micros,
        )

    def egress_env(self) -> dict[str, str]:
        """The proxy variables for the run's commands."""
        proxy = f"http://127.0.0.1:{self.settings.egress_port}"
        local = "localhost,127.0.0.1,::1"
        return {
            "http_proxy": proxy,
            "https_proxy": proxy,
            "HTTP_PROXY": proxy,
            "HTTPS_PROXY": proxy,
            "no_proxy": local,
            "NO_PROXY": local,
        }

    def tools(self, policy: Policy) -> list[ToolSpec]:
        return tools_for(policy)

    def handles(self, name: str) -> bool:
        return name in NAMES

    async def handle(self, call: ToolCall, *, ctx: BrokerContext) -> str:
        """Answer one tool call; a refusal is a tool error (and a ``*.denied`` event)."""
        if call.arguments_invalid:
            return f"error: the arguments of `{call.name}` are not a JSON object"
        if call.name == WEB_FETCH:
            if not ctx.policy.web_on:
                raw = call.arguments.get("url")
                await ctx.emit(
                    "web.denied",
                    {
                        "method": str(call.arguments.get("method", "GET"))[:16],
                        "url": public_url(raw) if isinstance(raw, str) else "",
                        "reason": "web access is off in this run's policy",
                        "cost_micros": 0,
                    },
                )
                return "error: tool `web_fetch` is not available in this run (web is off)"
            return await web.fetch(
                ctx,
                call.arguments,
                charge=lambda: self._charge_web(ctx),
                allow_private=self.allow_private,
                allowed=self.web_private,
            )
        if call.name == CONNECTION_CALL:
            return await connections.call(
                ctx, call.arguments, sealer=self.sealer, allow_private=self.allow_private
            )
        return f"error: tool `{call.name}` is not available in this run (not granted)"

    async def _charge_web(self, ctx: BrokerContext) -> int:
        """Charge one request inside the run's budget *before* it is sent."""
        return await ctx.charge_web(self._next_seq())

    def _next_seq(self) -> int:
        """The run's next web charge number (web_fetch and the proxy share the sequence)."""
        self._web_requests += 1
        return self._web_requests
