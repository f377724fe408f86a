"""One exception tree, one JSON error shape (RFC 9457 problem+json).

    EphemeralError                      500 generic
    ├── InvalidRequest                  422 with ``errors=[{field, message}]``
    │   ├── RecipeError                 422 names file, line and field
    │   └── DockerfileError             422 names the Dockerfile, line and instruction
    ├── Unauthorized                    401
    ├── NotFound                        404 (also another org's object: never 403)
    │   └── FileNotFound                404 a path inside a sandbox does not exist
    ├── FilePermissionDenied            403 the sandbox user may not read/write that path
    ├── IsADirectory                    409 a file operation on a directory in a sandbox
    ├── Conflict                        409
    ├── QueueFull                       429 the host's run queue is full (``Retry-After``)
    ├── PaymentRequired                 402 (balance or budget cannot cover the request)
    ├── PayloadTooLarge                 413
    ├── UnsupportedMediaType            415
    ├── IsolationUnavailable            422 asked-for isolation cannot run on this host
    ├── UnknownModel                    422 model not in the price book / no provider
    ├── SandboxError                    502 the sandbox or its guest agent failed or lied
    ├── RegistryError                   502 an image registry failed, refused or sent bad bytes
    ├── ModelError                      502 the model provider failed
    │   └── TransientModelError         retryable (429, 5xx, connection reset)
    ├── BudgetExhausted                 the next step does not fit the remaining budget
    └── IllegalTransition               500 code asked for a run status move the table forbids

The HTTP layer renders every one of them with :meth:`EphemeralError.to_problem`; the Python
client maps the status back to the same classes.
"""

from __future__ import annotations

from typing import Any, ClassVar


class EphemeralError(Exception):
    status: ClassVar[int] = 500
    slug: ClassVar[str] = "internal"
    title: ClassVar[str] = "Internal error"

    def __init__(
        self,
        detail: str,
        *,
        errors: list[dict[str, str]] | None = None,
        cause: BaseException | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.errors = errors
        self.cause = cause
        if cause is not None:
            self.__cause__ = cause

    def to_problem(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": f"https://ephemeral.dev/errors/{self.slug}",
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if self.errors:
            body["errors"] = self.errors
        return body


class InvalidRequest(EphemeralError):
    status = 422
    slug = "invalid-request"
    title = "Invalid request"

    @classmethod
    def field(cls, field: str, message: str) -> InvalidRequest:
        return cls(f"{field}: {message}", errors=[{"field": field, "message": message}])


class RecipeError(InvalidRequest):
    slug = "invalid-recipe"
    title = "Invalid recipe"


class DockerfileError(InvalidRequest):
    """A Dockerfile (or its context) asks for what the image builder does not honour, or a
    step of its build failed; ``path``, ``line`` and ``instruction`` say where."""

    slug = "invalid-dockerfile"
    title = "Dockerfile not buildable"

    def __init__(
        self,
        detail: str,
        *,
        path: str | None = None,
        line: int | None = None,
        instruction: str | None = None,
        errors: list[dict[str, str]] | None = None,
        cause: BaseException | None = None,
    ) -> None:
        super().__init__(detail, errors=errors, cause=cause)
        self.path = path
        self.line = line
        self.instruction = instruction


class Unauthorized(EphemeralError):
    status = 401
    slug = "unauthorized"
    title = "Unauthorized"


class NotFound(EphemeralError):
    status = 404
    slug = "not-found"
    title = "Not found"


class FileNotFound(NotFound):
    slug = "file-not-found"
    title = "File not found in the sandbox"


class FilePermissionDenied(EphemeralError):
    # 403 only for a path inside a sandbox: another org's object is still 404, never 403.
    status = 403
    slug = "file-permission-denied"
    title = "Permission denied in the sandbox"


class IsADirectory(EphemeralError):
    status = 409
    slug = "is-a-directory"
    title = "Is a directory"


class Conflict(EphemeralError):
    status = 409
    slug = "conflict"
    title = "Conflict"


class QueueFull(EphemeralError):
    status = 429
    slug = "queue-full"
    title = "Too many runs waiting"

    def __init__(self, detail: str, *, retry_after: float | None = None, **kw: Any) -> None:
        super().__init__(detail, **kw)
        self.retry_after = retry_after


class PaymentRequired(EphemeralError):
    status = 402
    slug = "insufficient-balance"
    title = "Insufficient balance"


class PayloadTooLarge(EphemeralError):
    status = 413
    slug = "payload-too-large"
    title = "Payload too large"


class UnsupportedMediaType(EphemeralError):
    status = 415
    slug = "unsupported-media-type"
    title = "Unsupported media type"


class IsolationUnavailable(EphemeralError):
    status = 422
    slug = "isolation-unavailable"
    title = "Isolation unavailable"


class UnknownModel(EphemeralError):
    status = 422
    slug = "unknown-model"
    title = "Unknown model"


class SandboxError(EphemeralError):
    status = 502
    slug = "sandbox-error"
    title = "Sandbox error"


class RegistryError(EphemeralError):
    status = 502
    slug = "registry-error"
    title = "Image registry error"


class ModelError(EphemeralError):
    status = 502
    slug = "model-error"
    title = "Model error"


class TransientModelError(ModelError):
    slug = "model-unavailable"
    title = "Model temporarily unavailable"

    def __init__(self, detail: str, *, retry_after: float | None = None, **kw: Any) -> None:
        super().__init__(detail, **kw)
        self.retry_after = retry_after


class BudgetExhausted(EphemeralError):
    status = 402
    slug = "budget-exhausted"
    title = "Budget exhausted"


class IllegalTransition(EphemeralError):
    """A bug, not a race: the caller asked for a move :data:`lifecycle.TRANSITIONS` forbids."""

    slug = "illegal-transition"
    title = "Illegal run status transition"


class PrefectIncompatible(EphemeralError):
    """The installed Prefect lacks a part Ephemeral touches beyond its public API (or is a
    version that was never tested): ``ephemeral.flows.prefect_private`` names each part."""

    slug = "prefect-incompatible"
    title = "Prefect version not supported"


ALL_ERRORS: tuple[type[EphemeralError], ...] = (
    EphemeralError,
    InvalidRequest,
    RecipeError,
    DockerfileError,
    Unauthorized,
    NotFound,
    Conflict,
    QueueFull,
    FileNotFound,
    FilePermissionDenied,
    IsADirectory,
    PaymentRequired,
    PayloadTooLarge,
    UnsupportedMediaType,
    IsolationUnavailable,
    UnknownModel,
    SandboxError,
    RegistryError,
    ModelError,
    TransientModelError,
    BudgetExhausted,
    IllegalTransition,
    PrefectIncompatible,
)


def error_for(status: int, slug: str | None = None) -> type[EphemeralError]:
    """The most specific class for a problem document (used by the client)."""
    if slug:
        for cls in reversed(ALL_ERRORS):
            if cls.slug == slug:
                return cls
    for cls in ALL_ERRORS:
        # A bare 500 is the generic error, not the one specific 500 that names its slug.
        if cls.status == status and cls.status != EphemeralError.status:
            return cls
    return EphemeralError
