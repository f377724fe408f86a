"""Host-side client of the guest agent, over any byte channel (pipes, a unix socket, ...).

Drivers own the channel and the process; this class owns the conversation. One request is in
flight at a time (the agent is sequential), so calls are serialised with a lock. Each request
carries a fresh random id (a 128-bit nonce) and only a reply echoing it is taken: a stale,
replayed or unasked-for frame is a lying guest. A failure of any kind marks the client broken:
the sandbox behind it can no longer be trusted, so every later call fails fast with the first
error, and :class:`GuestBacked` destroys the sandbox.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from pydantic import BaseModel, ValidationError

from ephemeral import errors
from ephemeral.sandbox import protocol as p
from ephemeral.sandbox.base import ExecResult
from ephemeral.sandbox.lifecycle import SandboxBase
from ephemeral.sandbox.streams import Accept, StreamMux

# Time the agent may take beyond a command's own deadline to kill it and reply.
EXEC_GRACE_SECONDS = 5.0
OP_TIMEOUT_SECONDS = 30.0
# base64 + JSON envelope of an exec reply carrying two capped streams
_ENVELOPE = 4096
# Files larger than this move in several put/get requests of this size (a frame is <= 16 MiB).
FILE_CHUNK = 8 << 20


class GuestClient:
    def __init__(
        self,
        reader: p.FrameReader,
        writer: p.FrameWriter,
        *,
        label: str = "guest",
        exec_grace: float = EXEC_GRACE_SECONDS,
        op_timeout: float = OP_TIMEOUT_SECONDS,
    ):
        self._reader = reader
        self._writer = writer
        self._lock = asyncio.Lock()
        self._broken: errors.SandboxError | None = None
        self.label = label
        self.exec_grace = exec_grace
        self.op_timeout = op_timeout
        self.hello: p.Hello | None = None
        self._mux: StreamMux | None = None

    @property
    def broken(self) -> bool:
        return self._broken is not None

    @property
    def workdir(self) -> str:
        if self.hello is None:
            raise errors.SandboxError(f"{self.label}: no hello from the guest agent yet")
        return self.hello.workdir

    async def handshake(self, timeout: float) -> p.Hello:
        """Wait for the agent's hello; check the protocol version."""
        try:
            obj = await p.read_frame(self._reader, timeout=timeout, max_frame=64 * 1024)
            hello = p.parse(p.Hello, obj, "hello frame")
            if hello.protocol != p.PROTOCOL_VERSION:
                raise errors.SandboxError(
                    f"guest agent speaks protocol {hello.protocol}, host speaks "
                    f"{p.PROTOCOL_VERSION}: rebuild the image (ephemeral images build)"
                )
        except errors.SandboxError as exc:
            self._broken = exc
            raise
        self.hello = hello
        return hello

    async def _call(self, req: BaseModel, timeout: float, max_frame: int) -> dict[str, Any]:
        if self._broken is not None:
            raise errors.SandboxError(f"{self.label}: unusable after: {self._broken.detail}")
        async with self._lock:
            try:
                if self._mux is not None:  # egress is on: the mux reads the channel
                    obj = await self._mux.call(req, timeout, max_frame)
                else:
                    self._writer.write(p.encode_frame(req))
                    async with asyncio.timeout(timeout):
                        await self._writer.drain()
                    obj = await p.read_frame(self._reader, timeout=timeout, max_frame=max_frame)
                rid = getattr(req, "id", None)
                if obj.get("id") != rid:
                    # a stale, replayed or forged frame: never echo its content
                    raise errors.SandboxError("guest sent a reply to a request not in flight")
                if obj.get("ok") is False:
                    err = p.parse(p.ErrorReply, obj, "error reply")
                    # A refused request is an answer, not a broken agent.
                    raise _GuestRefused(err.kind, err.error)
                return obj
            except _GuestRefused:
                raise
            except asyncio.CancelledError:
                # The guest answers this request later all the same: the next call would read
                # that reply as its own. Nothing is sent here again (teardown kills the guest).
                self._broken = errors.SandboxError(f"{self.label}: a call was abandoned mid-way")
                raise
            except TimeoutError:
                self._broken = errors.SandboxError(f"guest agent did not read for {timeout:.1f}s")
                raise self._broken from None
            except errors.SandboxError as exc:
                self._broken = exc
                raise
            except (ConnectionError, OSError) as exc:
                self._broken = errors.SandboxError(f"guest channel failed: {exc}")
                raise self._broken from exc

    async def exec(
        self,
        command: str | list[str],
        *,
        stdin: bytes = b"",
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = 30.0,
        max_output: int = 64 * 1024,
        user: str | None = None,
        stdin_path: str | None = None,
    ) -> ExecResult:
        if not isinstance(command, str) and (
            not command or not all(isinstance(a, str) for a in command)
        ):
            raise errors.InvalidRequest.field("command", "argv must be non-empty strings")
        try:
            req = p.ExecRequest(
                id=_nonce(),
                shell=command if isinstance(command, str) else None,
                argv=None if isinstance(command, str) else list(command),
                timeout=timeout,
                max_output=max_output,
                stdin=p.b64encode(stdin),
                env=env or {},
                cwd=cwd,
                user=user,
                stdin_path=stdin_path,
            )
        except ValidationError as exc:
            field = ".".join(map(str, exc.errors()[0]["loc"]))
            raise errors.InvalidRequest.field(field, exc.errors()[0]["msg"]) from None
        frame_cap = min(p.MAX_FRAME, 2 * (4 * max_output // 3 + 4) + _ENVELOPE)
        t0 = time.monotonic()
        try:
            obj = await self._call(req, timeout + self.exec_grace, frame_cap)
        except _GuestRefused as exc:
            if exc.kind == "bad_cwd":
                raise errors.InvalidRequest.field("cwd", exc.message) from None
            if exc.kind == "bad_stdin":
                raise errors.InvalidRequest.field("stdin_path", exc.message) from None
            if exc.kind == "bad_user":  # outside the id map, or root where it is host root
                raise errors.InvalidRequest.field("user", exc.message) from None
            raise errors.SandboxError(f"guest refused exec: {exc.kind}: {exc.message}") from None
        reply = self._checked(p.ExecReply, obj, "exec reply")
        # The guest's own clock is only believed below what the host saw elapse.
        host_ms = int((time.monotonic() - t0) * 1000) + 1
        out = self._b64(reply.stdout, "stdout", max_output)
        err = self._b64(reply.stderr, "stderr", max_output)
        return ExecResult(
            exit_code=reply.exit_code,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            duration_ms=min(reply.duration_ms, host_ms),
            truncated=reply.truncated,
            timed_out=reply.timed_out,
        )

    async def put_file(
        self, path: str, data: bytes, mode: int = 0o644, *, user: str | None = None
    ) -> None:
        """Write ``data`` to ``path``; with ``user``, as that user (its permissions apply).

        Larger than :data:`FILE_CHUNK`, it goes as one truncating write and appends."""
        view = memoryview(data)
        first = True
        while first or view:
            chunk, view = view[:FILE_CHUNK], view[FILE_CHUNK:]
            await self._put(path, bytes(chunk), mode, user=user, append=None if first else True)
            first = False

    async def _put(
        self, path: str, data: bytes, mode: int, *, user: str | None, append: bool | None
    ) -> None:
        req = p.PutRequest(
            id=_nonce(), path=path, data=p.b64encode(data), mode=mode, user=user, append=append
        )
        try:
            obj = await self._call(req, self.op_timeout, 64 * 1024)
        except _GuestRefused as exc:
            raise file_error("put", path, exc.kind, exc.message) from None
        reply = self._checked(p.PutReply, obj, "put reply")
        if reply.size != len(data):
            raise self._lie(f"put {path}: guest wrote {reply.size} of {len(data)} bytes")

    async def get_file(
        self, path: str, max_bytes: int = 1 << 20, *, user: str | None = None
    ) -> bytes:
        """The file at ``path`` (PayloadTooLarge past ``max_bytes``); with ``user``, read as
        that user. Larger than :data:`FILE_CHUNK`, it comes in windows (``offset``)."""
        if max_bytes <= FILE_CHUNK:
            return await self._get(path, max_bytes, user=user)
        data, size = await self._get_window(path, 0, FILE_CHUNK, user)
        if size > max_bytes:
            raise errors.PayloadTooLarge(f"{path}: {size} bytes, over the {max_bytes} limit")
        parts = [data]
        got = len(data)
        # A short window means the file ended (or shrank): the guest cannot keep the host
        # asking for byte after byte, at most size / FILE_CHUNK + 1 requests are made.
        short = len(data) < FILE_CHUNK
        while got < size and not short:
            want = min(FILE_CHUNK, size - got)
            window, _ = await self._get_window(path, got, want, user)
            parts.append(window)
            got += len(window)
            short = len(window) < want
        return b"".join(parts)[:size]

    async def _get(self, path: str, max_bytes: int, *, user: str | None) -> bytes:
        req = p.GetRequest(id=_nonce(), path=path, max_bytes=max_bytes, user=user)
        cap = min(p.MAX_FRAME, 4 * max_bytes // 3 + _ENVELOPE)
        try:
            obj = await self._call(req, self.op_timeout, cap)
        except _GuestRefused as exc:
            raise file_error("get", path, exc.kind, exc.message) from None
        reply = self._checked(p.GetReply, obj, "get reply")
        return self._b64(reply.data, "file", max_bytes)

    async def _get_window(
        self, path: str, offset: int, length: int, user: str | None
    ) -> tuple[bytes, int]:
        req = p.GetRequest(id=_nonce(), path=path, max_bytes=length, user=user, offset=offset)
        cap = min(p.MAX_FRAME, 4 * length // 3 + _ENVELOPE)
        try:
            obj = await self._call(req, self.op_timeout, cap)
        except _GuestRefused as exc:
            raise file_error("get", path, exc.kind, exc.message) from None
        reply = self._checked(p.GetReply, obj, "get reply")
        if reply.size is None:
            raise self._lie(f"get {path}: the guest did not say the file's size")
        return self._b64(reply.data, "file", length), reply.size

    async def reseed(self, entropy: bytes) -> bool:
        req = p.ReseedRequest(id=_nonce(), entropy=p.b64encode(entropy))
        try:
            obj = await self._call(req, self.op_timeout, 4096)
        except _GuestRefused as exc:
            raise errors.SandboxError(f"reseed: {exc.kind}: {exc.message}") from None
        return self._checked(p.ReseedReply, obj, "reseed reply").credited

    async def ping(self) -> None:
        try:
            obj = await self._call(p.PingRequest(id=_nonce()), self.op_timeout, 4096)
        except _GuestRefused as exc:
            raise errors.SandboxError(f"ping: {exc.kind}: {exc.message}") from None
        self._checked(p.EmptyReply, obj, "ping reply")

    async def kill_all(self) -> int:
        """SIGKILL every process of the worker uid and every command session; how many there
        were. Call it before anything whose result must not be touched by what ran before."""
        try:
            obj = await self._call(p.KillAllRequest(id=_nonce()), self.op_timeout, 4096)
        except _GuestRefused as exc:
            raise errors.SandboxError(f"kill_all: {exc.kind}: {exc.message}") from None
        return self._checked(p.KillAllReply, obj, "kill_all reply").killed

    async def start_egress(
        self, accept: Accept, *, port: int, max_streams: int, window: int
    ) -> StreamMux:
        """Start the guest's egress forwarder on 127.0.0.1:``port``; each connection made to it
        inside is handed to ``accept`` as a stream (``ephemeral.sandbox.streams``)."""
        if self._mux is not None:
            raise errors.SandboxError(f"{self.label}: egress is already on")
        if self._broken is not None:
            raise errors.SandboxError(f"{self.label}: unusable after: {self._broken.detail}")

        def broken(exc: errors.SandboxError) -> None:
            if self._broken is None:
                self._broken = exc

        # The mux reads the channel before the request goes out, so a stream the guest opens
        # as soon as it listens is already expected.
        self._mux = StreamMux(
            self._reader,
            self._writer,
            accept=accept,
            max_streams=max_streams,
            window=window,
            on_broken=broken,
        )
        req = p.EgressRequest(id=_nonce(), port=port, max_streams=max_streams, window=window)
        try:
            obj = await self._call(req, self.op_timeout, 4096)
        except _GuestRefused as exc:
            raise errors.SandboxError(f"egress: {exc.kind}: {exc.message}") from None
        if self._checked(p.EgressReply, obj, "egress reply").port != port:
            raise self._lie("egress: the guest listens on another port")
        return self._mux

    async def stop_egress(self) -> None:
        """Cut every stream and refuse new ones (the forwarder stays, answering nothing)."""
        if self._mux is not None:
            await self._mux.refuse_all()

    async def shutdown(self, timeout: float = 2.0) -> None:
        """Ask the agent to exit; best effort (the driver kills the sandbox anyway)."""
        if self._broken is not None:
            return
        try:
            await self._call(p.ShutdownRequest(id=_nonce()), timeout, 4096)
        except (errors.SandboxError, _GuestRefused):
            return

    def _checked(self, model: type[p.M], obj: dict[str, Any], what: str) -> p.M:
        try:
            return p.parse(model, obj, what)
        except errors.SandboxError as exc:
            self._broken = exc
            raise

    def _b64(self, value: str, field: str, cap: int) -> bytes:
        try:
            return p.b64decode(value, field=field, max_bytes=cap)
        except errors.SandboxError as exc:
            self._broken = exc
            raise

    def _lie(self, detail: str) -> errors.SandboxError:
        self._broken = errors.SandboxError(detail)
        return self._broken


def _nonce() -> str:
    return secrets.token_hex(16)


# errno names the agent puts first in an ``os_error`` ("EACCES: Permission denied")
_ERRNO_ERRORS: dict[str, type[errors.EphemeralError]] = {
    "ENOENT": errors.FileNotFound,
    "ENOTDIR": errors.FileNotFound,
    "EACCES": errors.FilePermissionDenied,
    "EPERM": errors.FilePermissionDenied,
    "EROFS": errors.FilePermissionDenied,
    "ELOOP": errors.FilePermissionDenied,  # O_NOFOLLOW met a symlink: refused, not followed
    "EISDIR": errors.IsADirectory,
}


def file_error(op: str, path: str, kind: str, message: str) -> errors.EphemeralError:
    """The error a refused put/get is, by the agent's kind (and errno name): the guest picks
    only which of these classes, never a status or a host path. ``path`` is the caller's."""
    if kind == "too_large":
        return errors.PayloadTooLarge(f"{path}: {message}")
    if kind == "is_a_directory":
        return errors.IsADirectory(f"{path}: is a directory")
    if kind == "not_a_file":
        return errors.FileNotFound(f"{path}: not a regular file")
    if kind in ("unknown_user", "bad_user"):
        return errors.InvalidRequest.field("user", message)
    if kind == "os_error":
        name = message.split(":", 1)[0]
        cls = _ERRNO_ERRORS.get(name)
        if cls is errors.IsADirectory:
            return cls(f"{path}: is a directory")
        if cls is not None:
            return cls(f"{path}: {message}")
        return (
            errors.FileNotFound(f"{path}: {message}")
            if op == "get"
            else errors.SandboxError(f"{op} {path}: {message}")
        )
    return errors.SandboxError(f"{op} {path}: {kind}: {message}")


class GuestBacked(SandboxBase):
    """The Sandbox methods that forward to a guest agent; drivers only start and tear down.

    A subclass sets ``_client`` once the agent said hello. A call that leaves the client broken
    (the guest lied, went silent or closed the channel) destroys the sandbox before the error
    reaches the caller.
    """

    _client: GuestClient | None = None

    def _guest(self) -> GuestClient:
        if self._destroyed or self._client is None:
            raise errors.SandboxError(f"sandbox {self.id} is destroyed")
        return self._client

    async def _on_error(self, client: GuestClient) -> None:
        if client.broken:
            await self.destroy()

    async def exec(
        self,
        command: str | list[str],
        *,
        stdin: bytes = b"",
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = 30.0,
        max_output: int = 64 * 1024,
        user: str | None = None,
        stdin_path: str | None = None,
    ) -> ExecResult:
        client = self._guest()
        try:
            return await client.exec(
                command,
                stdin=stdin,
                env=env,
                cwd=cwd,
                timeout=timeout,
                max_output=max_output,
                user=user,
                stdin_path=stdin_path,
            )
        except errors.SandboxError:
            await self._on_error(client)
            raise

    async def put_file(
        self, path: str, data: bytes, mode: int = 0o644, *, user: str | None = None
    ) -> None:
        client = self._guest()
        try:
            await client.put_file(path, data, mode, user=user)
        except errors.SandboxError:
            await self._on_error(client)
            raise

    async def get_file(
        self, path: str, max_bytes: int = 1 << 20, *, user: str | None = None
    ) -> bytes:
        client = self._guest()
        try:
            return await client.get_file(path, max_bytes, user=user)
        except errors.SandboxError:
            await self._on_error(client)
            raise

    async def start_egress(
        self, accept: Accept, *, port: int, max_streams: int, window: int
    ) -> StreamMux:
        """Start the egress forwarder inside (see GuestClient.start_egress)."""
        client = self._guest()
        try:
            return await client.start_egress(
                accept, port=port, max_streams=max_streams, window=window
            )
        except errors.SandboxError:
            await self._on_error(client)
            raise

    async def stop_egress(self) -> None:
        if self._client is not None:
            await self._client.stop_egress()

    async def kill_all(self) -> int:
        """Kill every process of the worker uid in the sandbox (see GuestClient.kill_all)."""
        client = self._guest()
        try:
            return await client.kill_all()
        except errors.SandboxError:
            await self._on_error(client)
            raise


class _GuestRefused(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
