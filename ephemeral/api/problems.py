"""Every error leaves the API as ``application/problem+json`` (RFC 9457), with the field named.

Our own exceptions render themselves (:meth:`EphemeralError.to_problem`); FastAPI's request
validation errors and Starlette's routing errors are translated into the same shape here, so a
client only ever has to read one kind of error body.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ephemeral import errors

log = logging.getLogger("ephemeral.api")

PROBLEM_JSON = "application/problem+json"
_LOCATIONS = ("body", "query", "header", "path", "cookie")
_TITLES = {404: "Not found", 405: "Method not allowed", 406: "Not acceptable"}
# Request models are strict (no "yes" for true, no "30" for 30): say which JSON type was wanted.
_TYPE_MESSAGES = {
    "bool_type": "must be a JSON boolean (true or false)",
    "int_type": "must be a JSON integer",
    "float_type": "must be a JSON number",
    "string_type": "must be a JSON string",
    "list_type": "must be a JSON array",
    "model_type": "must be a JSON object",
    "dict_type": "must be a JSON object",
}


def field_name(loc: Sequence[Any]) -> str:
    """``("body", "files", 0, "path")`` → ``files[0].path``; a header keeps its own name."""
    parts = list(loc)
    if len(parts) > 1 and parts[0] in _LOCATIONS:
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "body"


def _message(err: dict[str, Any]) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "is required"
    if kind in _TYPE_MESSAGES:
        return _TYPE_MESSAGES[kind]
    if kind == "json_invalid":
        return f"is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})"
    msg = str(err.get("msg", "is invalid"))
    return msg.removeprefix("Value error, ")


def validation_problem(exc: RequestValidationError) -> errors.InvalidRequest:
    items = []
    for err in exc.errors():
        loc = err.get("loc", ())
        if err.get("type") == "json_invalid":
            loc = ("body",)
        items.append({"field": field_name(loc), "message": _message(err)})
    detail = "; ".join(f"{i['field']}: {i['message']}" for i in items) or "invalid request"
    return errors.InvalidRequest(detail, errors=items)


def problem_response(
    exc: errors.EphemeralError, headers: dict[str, str] | None = None
) -> JSONResponse:
    hdrs = dict(headers or {})
    if isinstance(exc, errors.Unauthorized):
        hdrs.setdefault("WWW-Authenticate", 'Bearer realm="ephemeral"')
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        hdrs["Retry-After"] = str(max(1, int(retry_after)))
    return JSONResponse(
        exc.to_problem(), status_code=exc.status, headers=hdrs, media_type=PROBLEM_JSON
    )


async def _ephemeral(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, errors.EphemeralError)
    if exc.status >= 500:
        log.warning("request failed: %s: %s", type(exc).__name__, exc.detail)
    return problem_response(exc)


async def _validation(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return problem_response(validation_problem(exc))


async def _http(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    title = _TITLES.get(status, "Error")
    detail = exc.detail if isinstance(exc.detail, str) else title
    err_cls = errors.error_for(status)
    slug = err_cls.slug if err_cls.status == status else "http"
    body = {
        "type": f"https://ephemeral.dev/errors/{slug}",
        "title": title,
        "status": status,
        "detail": detail,
    }
    return JSONResponse(body, status_code=status, headers=exc.headers, media_type=PROBLEM_JSON)


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    # The detail stays generic: internals (paths, SQL, stack) are not the caller's business.
    log.exception("unhandled error", exc_info=exc)
    return problem_response(errors.EphemeralError("the server failed to handle the request"))


def install(app: FastAPI) -> None:
    app.add_exception_handler(errors.EphemeralError, _ephemeral)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _unexpected)
