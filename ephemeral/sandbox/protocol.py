"""The guest protocol, host side. Mirror of ``sandbox_images/default/guest/agent.py``.

Wire format: a 4-byte big-endian length, then that many bytes of UTF-8 JSON holding one object.
The agent speaks first with a ``hello`` frame; after that the host sends one request
(``{"id": NONCE, "op": ...}``) and waits for the reply with the same id before sending the next.
Binary payloads (stdin, stdout, files, entropy) travel base64-encoded.

Request ids are fresh 128-bit random nonces (32 hex digits), one per request: a process inside
the sandbox that somehow reached the channel could neither guess the id of the request in flight
nor replay an old reply, and the host takes no frame but the reply to the request it just sent
(anything else breaks the client; the sandbox is destroyed). Ops: ``exec``, ``put``, ``get``,
``reseed``, ``ping``, ``egress`` (start the egress forwarder: from then on stream frames
travel beside the replies, see ``ephemeral.sandbox.streams``), ``kill_all`` (SIGKILL every
process of the worker uid and every command session, and report how many; for a grader that
must run before anything the agent under test left running can touch the verdict) and
``shutdown``.

Everything the agent sends is hostile: frames are size-capped before they are read, nesting is
capped while they are parsed, they are parsed into strict models whose every field is bounded
(integers, string lengths, sizes), cross-checked against what was asked (ids, output caps), and
every read has a deadline. Any violation is a :class:`~ephemeral.errors.SandboxError`; the
caller destroys the sandbox, it never retries on a lying agent.
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
# Replies are flat objects; a newer agent's hello may nest a little. Deeper is hostile, and
# unbounded nesting would otherwise end in the parser's RecursionError.
MAX_DEPTH = 16
# Bounds of the integers the host takes from the guest. Each is far past any honest value and
# well inside a signed 64-bit column, so a guest number can never break the records writer.
MAX_PID = 1 << 22  # the kernel's PID_MAX_LIMIT
MAX_UID = (1 << 32) - 2  # uid_t, less the (uid_t)-1 "no uid" marker
MAX_PROTOCOL = 1 << 16
MAX_DURATION_MS = 7 * 24 * 3600 * 1000  # a sandbox never lives a week
MAX_TEXT = 4 * (MAX_FRAME // 3) + 4  # a base64 payload that fits in one frame

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
# A user of the image's /etc/passwd, by name or uid (optional field of exec, put and get).
User = Annotated[str, Field(pattern=r"^([a-z_][a-z0-9_.-]{0,31}|[0-9]{1,10})$")]


class Hello(_Frame):
    model_config = ConfigDict(extra="ignore", strict=True)  # newer agents may say more
    type: Literal["hello"]
    protocol: int = Field(ge=0, le=MAX_PROTOCOL)
    workdir: Annotated[
        str, Field(max_length=128, pattern=r"^/tmp/ephemeral-run-[A-Za-z0-9_]{1,64}/scratch$")
    ]
    pid: int = Field(ge=1, le=MAX_PID)
    uid: int = Field(ge=0, le=MAX_UID)


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
    # optional (absent: run as the worker, stdin from ``stdin``)
    user: User | None = None
    stdin_path: Path_ | None = None


class PutRequest(_Frame):
    id: Id
    op: Literal["put"] = "put"
    path: Path_
    data: str  # base64
    mode: int = Field(ge=0, le=0o7777)
    # optional (absent: root writes, the worker owns; truncate)
    user: User | None = None
    append: bool | None = None


class GetRequest(_Frame):
    id: Id
    op: Literal["get"] = "get"
    path: Path_
    max_bytes: int = Field(ge=0)
    # optional (absent: read as root, whole file up to max_bytes)
    user: User | None = None
    offset: int | None = Field(default=None, ge=0)


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


class EgressRequest(_Frame):
    """Start the guest's egress forwarder (``ephemeral.sandbox.streams``)."""

    id: Id
    op: Literal["egress"] = "egress"
    port: int = Field(ge=1, le=65535)
    max_streams: int = Field(ge=1, le=256)
    window: int = Field(ge=1, le=1 << 24)


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
    stdout: Annotated[str, Field(max_length=MAX_TEXT)]
    stderr: Annotated[str, Field(max_length=MAX_TEXT)]
    truncated: bool
    timed_out: bool
    duration_ms: int = Field(ge=0, le=MAX_DURATION_MS)


class GetReply(_Frame):
    id: Id
    ok: Literal[True]
    data: Annotated[str, Field(max_length=MAX_TEXT)]
    size: int | None = Field(default=None, ge=0, le=1 << 50)  # with ``offset``: the file's size


class PutReply(_Frame):
    id: Id
    ok: Literal[True]
    size: int = Field(ge=0, le=MAX_FRAME)


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


class EgressReply(_Frame):
    id: Id
    ok: Literal[True]
    port: int = Field(ge=1, le=65535)


# ---- egress stream frames (agent -> host); see ephemeral.sandbox.streams

STREAM_CHUNK = 128 * 1024  # raw bytes per data frame, both ways
MAX_STREAM_ID = 1 << 31
# A binary data frame: a length word with this bit set, then a 4-byte stream number and the
# bytes (no base64, no JSON); either side may send data so once egress is on.
BINARY = 1 << 31


def encode_data(sid: int, data: bytes | memoryview) -> bytes:
    return ((len(data) + 4) | BINARY).to_bytes(HEADER_BYTES, "big") + sid.to_bytes(4, "big") + data


class StreamFrame(_Frame):
    s: int = Field(ge=1, le=MAX_STREAM_ID)
    t: Literal["open", "data", "eof", "close", "ack"]
    d: Annotated[str, Field(max_length=4 * ((STREAM_CHUNK + 2) // 3))] | None = None
    n: int | None = Field(default=None, ge=1, le=1 << 24)


# ---- framing


def encode_frame(obj: BaseModel | dict[str, Any]) -> bytes:
    payload = obj.model_dump(exclude_none=True) if isinstance(obj, BaseModel) else obj
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    if len(body) > MAX_FRAME:
        raise errors.SandboxError(f"request frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return len(body).to_bytes(HEADER_BYTES, "big") + body


class FrameReader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


class FrameWriter(Protocol):
    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


async def read_frame(
    reader: FrameReader, *, timeout: float, max_frame: int = MAX_FRAME
) -> dict[str, Any]:
    """One frame as a dict; SandboxError on EOF, oversize, bad JSON, nesting deeper than
    ``MAX_DEPTH``, or no frame before timeout. Never any other exception."""
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
    return decode_frame(body)


def decode_frame(body: bytes) -> dict[str, Any]:
    """A frame body as a dict; SandboxError for anything but a shallow UTF-8 JSON object."""
    try:
        obj = json.loads(body.decode("utf-8"))
    except RecursionError:
        # the C parser checks the interpreter's recursion limit: a deep frame stops there
        raise errors.SandboxError(f"guest sent a frame nested deeper than {MAX_DEPTH}") from None
    except (UnicodeError, ValueError) as exc:  # ValueError also covers over-long int literals
        raise errors.SandboxError("guest sent a frame that is not UTF-8 JSON") from exc
    if not isinstance(obj, dict):
        raise errors.SandboxError("guest sent a frame that is not a JSON object")
    if _depth(obj) > MAX_DEPTH:
        raise errors.SandboxError(f"guest sent a frame nested deeper than {MAX_DEPTH}")
    return obj


def _depth(obj: object) -> int:
    """Nesting depth of parsed JSON, iteratively (the object may be ~1000 deep)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return depth
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return deepest


def parse(model: type[M], obj: dict[str, Any], what: str) -> M:
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        # loc may hold a guest-chosen key: bounded, like every guest string the host repeats
        loc = ".".join(map(str, first["loc"]))[:64] or "<frame>"
        raise errors.SandboxError(
            f"guest sent an invalid {what}: {loc}: {first['msg'][:200]}"
        ) from None


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
