"""The guest protocol, host side. Mirror of ``sandbox_images/default/guest/agent.py``.

Wire format: a 4-byte big-endian length, then that many bytes of UTF-8 JSON holding one object.
The agent speaks first with a ``hello`` frame; after that the host sends one request
(``{"id": NONCE, "op": ...}``) and waits for the reply with the same id before sending the next.
Binary payloads (stdin, stdout, files, entropy) travel base64-encoded.

Request ids are fresh 128-bit random nonces (32 hex digits), one per request: a process inside
the sandbox that somehow reached the channel could neither guess the id of the request in flight
nor replay an old reply, and the host takes no frame but the reply to the request it just sent
(anything else breaks the client; the sandbox is destroyed). Ops: ``exec``, ``put``, ``get``,
``reseed``, ``ping``, ``kill_all`` (SIGKILL every process of the worker uid and every command
session, and report how many; an eval's verify step calls it first so nothing the agent under
test left running can touch the verdict) and ``shutdown``.

Everything the agent sends is hostile: frames are size-capped before they are read, parsed into
strict models, cross-checked against what was asked (ids, output caps), and every read has a
deadline. Any violation is a :class:`~ephemeral.errors.SandboxError`; the caller destroys the
sandbox, it never retries on a lying agent.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from typing import Annotated, Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ephemeral import errors

PROTOCOL_VERSION = 2
MAX_FRAME = 16 << 20  # a reply larger than this is a lying or broken agent
HEADER_BYTES = 4

# request ops
OP_EXEC = "exec"
OP_PUT = "put"
OP_GET = "get"
OP_RESEED = "reseed"
OP_PING = "ping"
OP_KILL_ALL = "kill_all"
OP_SHUTDOWN = "shutdown"


M = TypeVar("M", bound=BaseModel)


class _Frame(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


Path_ = Annotated[str, Field(min_length=1, max_length=4096)]
# A request id: the host's nonce (secrets.token_hex(16)), echoed by the agent.
Id = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class Hello(_Frame):
    model_config = ConfigDict(extra="ignore", strict=True)  # newer agents may say more
    type: Literal["hello"]
    protocol: int
    workdir: Annotated[str, Field(pattern=r"^/tmp/ephemeral-run-[A-Za-z0-9_]{1,64}/scratch$")]
    pid: int = Field(ge=1)
    uid: int = Field(ge=0)


# ---- requests (host -> agent)


class ExecRequest(_Frame):
    id: Id
    op: Literal["exec"] = "exec"
    argv: list[str] | None = None
    shell: str | None = None
    stdin: str = ""  # base64
    env: dict[str, str] = {}
    cwd: str | None = None
    timeout: float = Field(gt=0)
    max_output: int = Field(ge=0)


class PutRequest(_Frame):
    id: Id
    op: Literal["put"] = "put"
    path: Path_
    data: str  # base64
    mode: int = Field(ge=0, le=0o7777)


class GetRequest(_Frame):
    id: Id
    op: Literal["get"] = "get"
    path: Path_
    max_bytes: int = Field(ge=0)


class ReseedRequest(_Frame):
    id: Id
    op: Literal["reseed"] = "reseed"
    entropy: str  # base64


class PingRequest(_Frame):
    id: Id
    op: Literal["ping"] = "ping"


class KillAllRequest(_Frame):
    id: Id
    op: Literal["kill_all"] = "kill_all"


class ShutdownRequest(_Frame):
    id: Id
    op: Literal["shutdown"] = "shutdown"


Request = (
    ExecRequest
    | PutRequest
    | GetRequest
    | ReseedRequest
    | PingRequest
    | KillAllRequest
    | ShutdownRequest
)


# ---- replies (agent -> host)


class ErrorReply(_Frame):
    id: Id
    ok: Literal[False]
    kind: Annotated[str, Field(max_length=64)]
    error: Annotated[str, Field(max_length=4096)]


class ExecReply(_Frame):
    id: Id
    ok: Literal[True]
    exit_code: int = Field(ge=-1, le=511)
    stdout: str
    stderr: str
    truncated: bool
    timed_out: bool
    duration_ms: int = Field(ge=0)


class GetReply(_Frame):
    id: Id
    ok: Literal[True]
    data: str


class PutReply(_Frame):
    id: Id
    ok: Literal[True]
    size: int = Field(ge=0)


class ReseedReply(_Frame):
    id: Id
    ok: Literal[True]
    credited: bool


class KillAllReply(_Frame):
    id: Id
    ok: Literal[True]
    killed: int = Field(ge=0, le=1 << 22)


class EmptyReply(_Frame):
    id: Id
    ok: Literal[True]


# ---- framing


def encode_frame(obj: BaseModel | dict[str, Any]) -> bytes:
    payload = obj.model_dump(exclude_none=True) if isinstance(obj, BaseModel) else obj
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    if len(body) > MAX_FRAME:
        raise errors.SandboxError(f"request frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return len(body).to_bytes(HEADER_BYTES, "big") + body


class FrameReader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


async def read_frame(
    reader: FrameReader, *, timeout: float, max_frame: int = MAX_FRAME
) -> dict[str, Any]:
    """One frame as a dict; SandboxError on EOF, oversize, bad JSON, or no frame before timeout."""
    try:
        async with asyncio.timeout(timeout):
            header = await reader.readexactly(HEADER_BYTES)
            size = int.from_bytes(header, "big")
            if size > max_frame:
                raise errors.SandboxError(f"guest sent a {size}-byte frame (cap {max_frame})")
            body = await reader.readexactly(size)
    except TimeoutError:
        raise errors.SandboxError(f"guest agent silent for {timeout:.1f}s") from None
    except asyncio.IncompleteReadError as exc:
        raise errors.SandboxError(
            "guest agent closed the channel" + (" mid-frame" if exc.partial else "")
        ) from None
    except (ConnectionError, OSError) as exc:
        raise errors.SandboxError(f"guest channel failed: {exc}") from exc
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise errors.SandboxError("guest sent a frame that is not UTF-8 JSON") from exc
    if not isinstance(obj, dict):
        raise errors.SandboxError("guest sent a frame that is not a JSON object")
    return obj


def parse(model: type[M], obj: dict[str, Any], what: str) -> M:
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(map(str, first["loc"])) or "<frame>"
        raise errors.SandboxError(f"guest sent an invalid {what}: {loc}: {first['msg']}") from None


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64decode(value: str, *, field: str, max_bytes: int) -> bytes:
    # Check the encoded length first: decoding an oversized string is itself the attack.
    if len(value) > 4 * ((max_bytes + 2) // 3):
        raise errors.SandboxError(f"guest {field} exceeds the {max_bytes}-byte cap")
    try:
        data = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise errors.SandboxError(f"guest {field} is not valid base64") from None
    if len(data) > max_bytes:
        raise errors.SandboxError(f"guest {field} exceeds the {max_bytes}-byte cap")
    return data
