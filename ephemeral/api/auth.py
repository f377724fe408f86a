"""Who is calling: a member key as ``Authorization: Bearer`` (API) or the page cookie (pages).

The API never accepts the cookie, so a page a member has open cannot be used to drive the API
from another site (no CSRF on ``/v1``); page forms are same-site only (``SameSite=Strict``) and
check ``Origin``.
"""

from __future__ import annotations

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ephemeral import errors
from ephemeral.engine.runtime import Runtime
from ephemeral.store import Principal

PAGE_COOKIE = "ephemeral_key"

bearer = HTTPBearer(auto_error=False, description="A member key: `Bearer <key>`")


def get_runtime(request: Request) -> Runtime:
    runtime: Runtime | None = getattr(request.app.state, "runtime", None)
    if runtime is None:
        raise errors.EphemeralError("the server is starting or stopping")
    return runtime


async def principal(
    request: Request,
    credentials: HTTPAuthorizationCredentials | None = Depends(bearer),
) -> Principal:
    if credentials is None:
        raise errors.Unauthorized("send a member key as 'Authorization: Bearer <key>'")
    if credentials.scheme.lower() != "bearer":
        raise errors.Unauthorized("the Authorization scheme must be Bearer")
    return await get_runtime(request).store.keys.authenticate(credentials.credentials)


async def page_principal(request: Request) -> Principal | None:
    """The member signed in to the pages, or None."""
    key = request.cookies.get(PAGE_COOKIE)
    if not key:
        return None
    try:
        return await get_runtime(request).store.keys.authenticate(key)
    except errors.Unauthorized:
        return None
