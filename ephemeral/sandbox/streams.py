"""Egress streams over the guest channel, host side (the guest half is ``Forwarder`` in the
guest agent).

The sandbox has no network device. When a run may reach the outside (``web`` or connections),
the host asks the guest agent to start a forwarder: a TCP listener on ``127.0.0.1`` inside the
sandbox whose every accepted connection becomes a *stream* on the agent's one channel. From
then on a single reader task owns the channel: replies go to the request in flight (matched by
its nonce, as before), stream frames to their stream, and the broker decides what each stream
may reach (``ephemeral.broker.egress``).

What the host accepts from the guest, and nothing else (anything else breaks the client and the
sandbox is destroyed):

- ``open`` only for the next stream number (1, 2, 3, ...) and below ``max_streams`` open at once;
- ``data`` only on an open stream, at most ``STREAM_CHUNK`` bytes, and never more than
  ``window`` bytes the host has not acknowledged yet (so a guest cannot fill host memory);
- ``ack`` never for more bytes than the host sent and the guest has not acknowledged;
- a frame for a stream the host already closed is dropped (it crossed the host's close);
- a reply only while a request is in flight, with its nonce.

A frame's size is checked before it is read: a stream frame is small, and only the request in
flight may be answered by a larger frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel

from ephemeral import errors
from ephemeral.sandbox import protocol as p

log = logging.getLogger("ephemeral.sandbox.streams")

STREAM_FRAME_CAP = 256 * 1024  # encoded size of the largest honest stream frame
BODY_SECONDS = 30.0  # a frame whose header arrived must be complete by then

Accept = Callable[["GuestStream"], Awaitable[None]]


class GuestStream:
    """One TCP connection inside the sandbox, as a byte stream for the broker."""

    def __init__(self, mux: StreamMux, sid: int) -> None:
        self.mux = mux
        self.sid = sid
        self._buf = bytearray()
        self._ready = asyncio.Event()
        self.eof = False  # the guest shut its sending side
        self.closed = False  # either side closed: no more data either way
        self.unacked_in = 0  # bytes received and not yet acknowledged
        self.unacked_out = 0  # bytes sent and not yet acknowledged by the guest
        self._credit = asyncio.Event()
        self._credit.set()

    async def read(self, n: int = p.STREAM_CHUNK) -> bytes:
        """Up to ``n`` bytes; ``b""`` at end of stream (EOF or closed)."""
        while not self._buf:
            if self.eof or self.closed:
                return b""
            self._ready.clear()
            await self._ready.wait()
        data = bytes(self._buf[:n])
        del self._buf[:n]
        self.unacked_in -= len(data)
        if not self.closed:
            await self.mux.send({"s": self.sid, "t": "ack", "n": len(data)})
        return data

    async def write(self, data: bytes) -> None:
        """Send bytes to the connection inside; ConnectionError once the stream is closed."""
        view = memoryview(data)
        while view:
            if self.closed:
                raise ConnectionError("the sandbox side of the stream is closed")
            room = self.mux.window - self.unacked_out
            if room <= 0:
                self._credit.clear()
                await self._credit.wait()
                continue
            piece = view[: min(room, p.STREAM_CHUNK)]  # framed below: the one copy it takes
            view = view[len(piece) :]
            self.unacked_out += len(piece)
            await self.mux.send_data(self.sid, piece)

    async def close(self) -> None:
        """Close the connection inside (idempotent)."""
        if self.closed and self.sid not in self.mux.streams:
            return
        self._end()
        with contextlib.suppress(errors.SandboxError, ConnectionError, OSError):
            await self.mux.send({"s": self.sid, "t": "close"})

    def _end(self) -> None:
        self.closed = True
        self.mux.streams.pop(self.sid, None)
        self._ready.set()
        self._credit.set()


class StreamMux:
    """Owns the channel's reading once egress is on; see the module docstring."""

    def __init__(
        self,
        reader: p.FrameReader,
        writer: p.FrameWriter,
        *,
        accept: Accept,
        max_streams: int,
        window: int,
        on_broken: Callable[[errors.SandboxError], None],
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._accept = accept
        self.max_streams = max_streams
        self.window = window
        self._on_broken = on_broken
        self.streams: dict[int, GuestStream] = {}
        self.next_sid = 1
        self._write_lock = asyncio.Lock()
        self._pending: tuple[str, int, asyncio.Future[dict[str, Any]]] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: errors.SandboxError | None = None
        self.refusing = False  # the broker is gone: every new stream is closed at once
        self._reader_task = asyncio.create_task(self._read_loop(), name="guest-stream-reader")

    # -- requests (GuestClient._call in mux mode) -------------------------------------------
    async def call(self, req: BaseModel, timeout: float, max_frame: int) -> dict[str, Any]:
        if self._failed is not None:
            raise self._failed
        rid = str(getattr(req, "id", ""))
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending = (rid, max_frame, fut)
        try:
            async with asyncio.timeout(timeout):
                await self._write(p.encode_frame(req))
                return await fut
        except TimeoutError:
            raise self._fail(
                errors.SandboxError(f"guest agent did not answer for {timeout:.1f}s")
            ) from None
        finally:
            self._pending = None

    # -- writing ------------------------------------------------------------------------------
    async def send(self, frame: dict[str, Any]) -> None:
        if self._failed is not None:
            raise ConnectionError("the guest channel is closed")
        await self._write(p.encode_frame(frame))

    async def send_data(self, sid: int, data: bytes | memoryview) -> None:
        if self._failed is not None:
            raise ConnectionError("the guest channel is closed")
        await self._write(p.encode_data(sid, data))

    async def _write(self, data: bytes) -> None:
        async with self._write_lock:
            try:
                self._writer.write(data)
                await self._writer.drain()
            except (ConnectionError, OSError) as exc:
                raise self._fail(errors.SandboxError(f"guest channel failed: {exc}")) from exc

    # -- reading ------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    header = await self._reader.readexactly(p.HEADER_BYTES)
                    size = int.from_bytes(header, "big")
                    if size & p.BINARY:
                        size &= ~p.BINARY
                        if not 4 < size <= p.STREAM_CHUNK + 4:
                            raise errors.SandboxError(f"guest sent a {size}-byte data frame")
                        async with asyncio.timeout(BODY_SECONDS):
                            body = await self._reader.readexactly(size)
                        await self._on_data(int.from_bytes(body[:4], "big"), body[4:])
                        continue
                    cap = STREAM_FRAME_CAP
                    if self._pending is not None:
                        cap = max(cap, self._pending[1])
                    if size > cap:
                        raise errors.SandboxError(f"guest sent a {size}-byte frame (cap {cap})")
                    async with asyncio.timeout(BODY_SECONDS):
                        body = await self._reader.readexactly(size)
                except asyncio.IncompleteReadError:
                    raise errors.SandboxError("guest agent closed the channel") from None
                except TimeoutError:
                    raise errors.SandboxError("guest agent stalled mid-frame") from None
                except (ConnectionError, OSError) as exc:
                    raise errors.SandboxError(f"guest channel failed: {exc}") from exc
                obj = p.decode_frame(body)
                if "s" in obj and "id" not in obj:
                    await self._on_stream_frame(p.parse(p.StreamFrame, obj, "stream frame"))
                    continue
                pending = self._pending
                if pending is None or obj.get("id") != pending[0] or pending[2].done():
                    raise errors.SandboxError("guest sent a reply to a request not in flight")
                if size > pending[1]:
                    raise errors.SandboxError(f"guest sent a {size}-byte reply (cap {pending[1]})")
                pending[2].set_result(obj)
        except errors.SandboxError as exc:
            self._fail(exc)
        except asyncio.CancelledError:
            self._fail(errors.SandboxError("the guest channel reader stopped"))
            raise

    async def _on_stream_frame(self, f: p.StreamFrame) -> None:
        if f.t == "open":
            if f.s != self.next_sid:
                raise errors.SandboxError(f"guest opened stream {f.s}, expected {self.next_sid}")
            if len(self.streams) >= self.max_streams:
                raise errors.SandboxError(f"guest opened more than {self.max_streams} streams")
            self.next_sid += 1
            new = GuestStream(self, f.s)
            self.streams[f.s] = new
            if self.refusing:
                await new.close()
                return
            task = asyncio.create_task(self._serve(new), name=f"guest-stream-{f.s}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        stream = self.streams.get(f.s)
        if stream is None:
            if f.s >= self.next_sid:
                raise errors.SandboxError(f"guest sent a frame for stream {f.s} it never opened")
            return  # crossed our close
        if f.t == "data":
            if f.d is None:
                raise errors.SandboxError(f"guest sent a data frame without data on stream {f.s}")
            await self._on_data(
                f.s, p.b64decode(f.d, field="stream data", max_bytes=p.STREAM_CHUNK)
            )
        elif f.t == "ack":
            if f.n is None or f.n > stream.unacked_out:
                raise errors.SandboxError(f"guest acknowledged bytes never sent on stream {f.s}")
            stream.unacked_out -= f.n
            stream._credit.set()
        elif f.t == "eof":
            stream.eof = True
            stream._ready.set()
        else:  # close
            await stream.close()

    async def _on_data(self, sid: int, data: bytes) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            if not 1 <= sid < self.next_sid:
                raise errors.SandboxError(f"guest sent data for stream {sid} it never opened")
            return  # crossed our close
        if stream.eof:
            raise errors.SandboxError(f"guest sent data on stream {sid} after its end")
        if not data or stream.unacked_in + len(data) > self.window:
            raise errors.SandboxError(f"guest overran the window of stream {sid}")
        stream.unacked_in += len(data)
        stream._buf += data
        stream._ready.set()

    async def _serve(self, stream: GuestStream) -> None:
        try:
            await self._accept(stream)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("egress stream %d failed; closed", stream.sid)
        finally:
            await stream.close()

    # -- ending -------------------------------------------------------------------------------
    def _fail(self, exc: errors.SandboxError) -> errors.SandboxError:
        if self._failed is None:
            self._failed = exc
            for stream in list(self.streams.values()):
                stream._end()
            if self._pending is not None and not self._pending[2].done():
                self._pending[2].set_exception(exc)
            self._on_broken(exc)
        return self._failed

    async def refuse_all(self) -> None:
        """Fail closed: cut every open stream, and close each new one as it opens."""
        self.refusing = True
        me = asyncio.current_task()
        others = [t for t in self._tasks if t is not me]  # the broker's own stream may ask
        for stream in list(self.streams.values()):
            await stream.close()
        if others:
            # Each handler sees its stream closed and ends, recording what it moved before the
            # run's books close; one that does not is cancelled.
            _, late = await asyncio.wait(others, timeout=2.0)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=2.0)

    async def aclose(self) -> None:
        self.refusing = True
        for task in list(self._tasks):
            task.cancel()
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader_task
