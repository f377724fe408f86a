"""The model tools the broker serves, built from the run's policy (not granted: absent)."""

from __future__ import annotations

from ephemeral.policy import Policy
from ephemeral.providers.base import ToolSpec

WEB_FETCH = "web_fetch"
CONNECTION_CALL = "connection_call"
NAMES = frozenset({WEB_FETCH, CONNECTION_CALL})

WEB_FETCH_TOOL = ToolSpec(
    name=WEB_FETCH,
    description=(
        "Fetch a public http(s) URL. The host makes the request, not the sandbox; each request "
        "(including each redirect) is charged to the run's budget. Returns status, content type "
        "and the start of the body as text."
    ),
    parameters={
        "type": "object",
        "properties": {
            "url": {"type": "string", "description": "An http:// or https:// URL."},
            "method": {"type": "string", "enum": ["GET", "HEAD"], "default": "GET"},
        },
        "required": ["url"],
        "additionalProperties": False,
    },
)


def connection_tool(policy: Policy) -> ToolSpec:
    """A ``connection_call`` spec naming exactly what the policy allows."""
    lines = [
        f"- {c.name}: methods {', '.join(c.methods)}; paths {', '.join(c.paths)}"
        for c in policy.connections
    ]
    methods = sorted({m for c in policy.connections for m in c.methods})
    return ToolSpec(
        name=CONNECTION_CALL,
        description=(
            "Call an API through a named connection. The host adds the credentials; you never "
            "see them. Give a path (with an optional query string) relative to the connection's "
            "base URL. Allowed:\n" + "\n".join(lines)
        ),
        parameters={
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [c.name for c in policy.connections]},
                "method": {"type": "string", "enum": methods},
                "path": {"type": "string", "description": "Starts with '/', e.g. /repos/x/y"},
                "body": {"type": "string", "description": "Request body (JSON text), optional."},
            },
            "required": ["name", "method", "path"],
            "additionalProperties": False,
        },
    )


def tools_for(policy: Policy) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    if policy.web_on:
        specs.append(WEB_FETCH_TOOL)
    if policy.connections:
        specs.append(connection_tool(policy))
    return specs
