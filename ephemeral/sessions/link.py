"""The internal channel between API processes and worker hosts (docs/deploy.md, "Sessions on
worker hosts"; docs/security.md, "The internal channel").

A session placed on a worker host is driven from any API process through this channel: one
TCP connection carries signed request frames one after another, each answered by one signed
response frame. A frame is a 4-byte big-endian header length, the header (JSON) and then
``body_len`` raw bytes (an exec request, a file, a command's output).

Both directions are authenticated with HMAC-SHA256 under a key derived from the cluster's seal
key (``EPHEMERAL_SEAL_KEY_FILE``, which every host shares anyway): only a process holding that
key can ask a host to act, and only the host asked can answer (the answer is signed over the
request's nonce). A request is bound to the host it is for and to that host's process (its
``instance``, which changes at every start), to a time within ``SKEW_SECONDS`` of the host's
clock and to a fresh 128-bit nonce the host has not seen; the body is bound by its SHA-256.
Anything else is refused before any of it is acted on.

The listener binds only a loopback or private IP address (:func:`check_bind_address`); a
public, wildcard or link-local address is refused at start.

Whoever can reach the port can open connections without the key, so what they may hold is
bounded (:class:`Limits`): connections at once, and per address those that have not yet sent an
authentic request; such a connection has a few seconds to send one. At the cap the oldest
unauthenticated connection gives its place to the new one (an API process's request arrives
within milliseconds of its connect, so a flood cannot lock it out); with every connection
authenticated, a new one is reset as it is accepted, before anything is made for it. A header
is parsed only once its nesting is known to be shallow.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import secrets
import socket
import struct
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ephemeral import errors
from ephemeral.settings import Settings

log = logging.getLogger("ephemeral.sessions.link")

VERSION = 1
MAX_HEADER = 64 << 10
MAX_BODY = 160 << 20  # a 128 MiB file plus room; an exec's output is far less
# Our headers nest three levels (a problem's errors); the parser recurses once a level.
MAX_DEPTH = 32
MAX_BRACKETS = 1024  # outside strings
SKEW_SECONDS = 30.0  # a request older or newer than this (by the host's clock) is refused
SERVER_IDLE_SECONDS = 60.0
# A pooled connection idle longer than this is not reused: well under the server's idle close,
# so an end of stream on a reused connection is a real failure, never a race with that close.
CLIENT_IDLE_SECONDS = 20.0
POOL_PER_HOST = 16
CONNECT_SECONDS = 5.0
BACKLOG = 1024
# Connections taken per wake of the listening socket: a flood cannot starve the connections
# already open, and a new one is never pushed out by its own batch.
ACCEPT_BATCH = 16
DRAIN_READS = 4  # of 64 KiB, before a refused connection closes
ACCEPT_PAUSE_SECONDS = 0.5  # out of descriptors: accepting waits this long for some to close
LOG_EVERY_SECONDS = 10.0  # refusals are counted; a line says so at most this often
_LABEL = b"ephemeral/hostlink/v1"
_REQ = b"request\n"
_RESP = b"response\n"

# Where the channel may listen besides loopback: the private networks of RFC 1918 and 4193.
# Not "not global" in general: link-local (the metadata service), documentation and reserved
# ranges are no one's private network.
PRIVATE_NETWORKS = tuple(
    ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
)

Handler = Callable[[str, dict[str, Any], bytes], Awaitable[tuple[dict[str, Any], bytes]]]


class LinkError(errors.EphemeralError):
    """The host could not be reached, broke the connection or did not answer correctly."""


class LinkRefused(LinkError):
    """The host refused the request as unauthenticated (a wrong key, a replay, a stale time)."""


def link_key(seal_key_path: Path) -> bytes:
    """The channel's key: derived from the shared seal key, never the seal key itself."""
    try:
        seal = seal_key_path.read_bytes().strip()
    except OSError as exc:
        raise errors.EphemeralError(
            f"the internal channel needs the cluster's seal key ({seal_key_path}): {exc}"
        ) from exc
    if not seal:
        raise errors.EphemeralError(f"the seal key file {seal_key_path} is empty")
    return hmac.new(seal, _LABEL, hashlib.sha256).digest()


def check_bind_address(address: str) -> str:
    """The address to listen on, if it is a loopback or private IP literal; else an error
    naming ``EPHEMERAL_LINK_ADDRESS``. A wildcard (``0.0.0.0``, ``::``) is refused: it would
    also listen on every public address of the host."""
    field = "EPHEMERAL_LINK_ADDRESS"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise errors.InvalidRequest.field(
            field, f"{address!r} is not an IP address (name the loopback or private address)"
        ) from None
    if ip.is_unspecified:
        raise errors.InvalidRequest.field(
            field, f"{address} listens on every address, public ones included: name one"
        )
    if not (ip.is_loopback or any(ip in net for net in PRIVATE_NETWORKS)):
        raise errors.InvalidRequest.field(
            field,
            f"{address} is not a loopback or private address: the internal channel binds only "
            "127.0.0.0/8, ::1 or a private network (10/8, 172.16/12, 192.168/16, fc00::/7)",
        )
    return str(ip)


def _default(name: str) -> Any:
    return Settings.model_fields[name].default


@dataclass(frozen=True)
class Limits:
    """What unauthenticated peers may hold of a host (the ``EPHEMERAL_LINK_*`` settings)."""

    connections: int = _default("link_max_connections")
    unauthenticated_per_peer: int = _default("link_max_unauthenticated_per_peer")
    auth_seconds: float = _default("link_auth_seconds")

    @classmethod
    def for_settings(cls, settings: Settings) -> Limits:
        return cls(
            connections=settings.link_max_connections,
            unauthenticated_per_peer=settings.link_max_unauthenticated_per_peer,
            auth_seconds=settings.link_auth_seconds,
        )


def _canon(header: dict[str, Any]) -> bytes:
    return json.dumps(
        {k: v for k, v in header.items() if k != "sig"}, sort_keys=True, separators=(",", ":")
    ).encode()


def _sign(key: bytes, label: bytes, header: dict[str, Any]) -> str:
    return hmac.new(key, label + _canon(header), hashlib.sha256).hexdigest()


def _verify(key: bytes, label: bytes, header: dict[str, Any]) -> bool:
    sig = header.get("sig")
    return isinstance(sig, str) and hmac.compare_digest(sig, _sign(key, label, header))


# A JSON string, unterminated ones included (possessive: linear on any input).
_STRINGS = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\Z)', re.S)
_ONE_KIND = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _too_deep(raw: bytes) -> bool:
    """Whether JSON text nests deeper than MAX_DEPTH or has over MAX_BRACKETS brackets, found
    without a recursive parse and in bounded time: strings dropped and both bracket kinds made
    one, each pass of ``replace`` removes exactly the innermost level (brackets that never pair
    up are left over too: not JSON anyway)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:  # ours, unless a path is all brackets
        return False
    rest = _STRINGS.sub(b"", raw).translate(_ONE_KIND, _NOT_BRACKETS)
    if len(rest) > MAX_BRACKETS:  # our headers have a dozen; this bounds the passes' work
        return True
    for passes_left in range(MAX_DEPTH, 0, -1):
        if len(rest) <= 2 * passes_left:  # too few brackets left to be that deep
            return False
        inner = rest.replace(b"[]", b"")
        if len(inner) == len(rest):  # no innermost pair: they do not pair up
            return True
        rest = inner
    return bool(rest)


def _header_size(prefix: bytes | bytearray) -> int:
    (size,) = struct.unpack(">I", prefix)
    if not 0 < size <= MAX_HEADER:
        raise LinkError(f"a frame header of {size} bytes (the cap is {MAX_HEADER})")
    return int(size)


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode()  # UTF-8 only: the depth check below reads bytes as ASCII
    except UnicodeDecodeError as exc:
        raise LinkError("a frame header that is not UTF-8") from exc
    if _too_deep(raw):
        raise LinkError(
            f"a frame header nested deeper than {MAX_DEPTH} levels or with over "
            f"{MAX_BRACKETS} brackets (or not JSON)"
        )
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise LinkError("a frame header that is not JSON") from exc
    if not isinstance(header, dict):
        raise LinkError("a frame header that is not an object")
    body_len = header.get("body_len", 0)
    if not isinstance(body_len, int) or isinstance(body_len, bool) or not 0 <= body_len <= MAX_BODY:
        raise LinkError(f"a frame body of {body_len!r} bytes (the cap is {MAX_BODY})")
    return header


async def _read_header(reader: asyncio.StreamReader) -> dict[str, Any]:
    """A frame's header; its ``body_len`` bytes follow, read by the caller once it trusts it."""
    size = _header_size(await reader.readexactly(4))
    return _parse_header(await reader.readexactly(size))


def _frame(header: dict[str, Any], body: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack(">I", len(raw)) + raw + body


def split_frame(frame: bytes) -> tuple[dict[str, Any], bytes]:
    """A whole frame handed over in one piece (no socket): its checked header and its body."""
    if len(frame) < 4:
        raise LinkError("a frame shorter than its length prefix")
    size = _header_size(frame[:4])
    header = _parse_header(frame[4 : 4 + size])
    body = frame[4 + size :]
    if len(body) != header["body_len"]:
        raise LinkError(
            f"a frame body of {len(body)} bytes where its header says {header['body_len']}"
        )
    return header, body


def _refusal(why: str) -> bytes:
    # Unsigned: whoever sent the request is trusted with nothing but the refusal.
    return _frame({"v": VERSION, "refused": why, "body_len": 0}, b"")


def _sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@dataclass(frozen=True)
class Peer:
    """Where a host's channel listens, and which process of it is there now."""

    host: str
    address: str  # "ip:port"
    instance: str


class _Conn:
    """One accepted connection. Until its first request is authentic it is this record and a
    read callback (no task, no streams): what a flood can make us hold is small."""

    __slots__ = ("buf", "fd", "peer", "since", "sock", "task")

    def __init__(self, peer: str, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        self.since = time.monotonic()
        self.buf = bytearray()  # the first frame's length and header, as they arrive
        self.task: asyncio.Task[None] | None = None  # once authenticated


def _reset(sock: socket.socket) -> None:
    """Close with a reset: no FIN handshake and no TIME_WAIT kept for a peer we turned away."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class LinkServer:
    """A host's end: verifies each request, hands it to ``handler(op, args, body)`` and signs
    the answer. A handler's :class:`~ephemeral.errors.EphemeralError` goes back as a problem."""

    def __init__(
        self, key: bytes, host: str, handler: Handler, limits: Limits | None = None
    ) -> None:
        self.key = key
        self.host = host
        self.instance = secrets.token_hex(16)
        self.handler = handler
        self.limits = limits or Limits()
        self._seen: dict[str, float] = {}  # nonce -> when it expires from the window
        self._sock: socket.socket | None = None
        self.address = ""
        self._conns: set[_Conn] = set()
        # Not yet authenticated, oldest first: all of them, and per peer address.
        self._unauthenticated: dict[_Conn, None] = {}
        self._unauthenticated_of: dict[str, dict[_Conn, None]] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self.refused: Counter[str] = Counter()  # why connections were turned away, since start
        self._log_after = 0.0
        self.closed = False

    async def start(self, address: str, port: int = 0) -> str:
        bind = check_bind_address(address)
        sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind, port))
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self._accept)
        self._sweeper = loop.call_later(self._sweep_every, self._sweep)
        at = sock.getsockname()
        self.address = f"[{at[0]}]:{at[1]}" if ":" in at[0] else f"{at[0]}:{at[1]}"
        return self.address

    async def close(self) -> None:
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for conn in list(self._unauthenticated):
            self._close_early(conn)
        tasks = [c.task for c in self._conns if c.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def connections(self) -> int:
        return len(self._conns)

    @property
    def _sweep_every(self) -> float:
        return min(1.0, self.limits.auth_seconds / 4)

    # before authentication: callbacks on the loop ------------------------------------------
    def _accept(self) -> None:
        """Take what is waiting on the listening socket (a batch), each within the caps."""
        if self._sock is None:
            return
        loop = asyncio.get_running_loop()
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: accept again once some have closed
                self._turned_away(f"accept failed: {exc}", "-")
                self._pause_accepting()
                return
            peer = str(addr[0])
            if not self._make_room(peer):
                _reset(sock)  # nothing was made for it
                self._turned_away("at the connection cap", peer)
                continue
            sock.setblocking(False)
            conn = _Conn(peer, sock)
            self._conns.add(conn)
            self._unauthenticated[conn] = None
            self._unauthenticated_of.setdefault(peer, {})[conn] = None
            loop.add_reader(conn.fd, self._first_bytes, conn)

    def _make_room(self, peer: str) -> bool:
        """Room for one more connection from ``peer``: the oldest unauthenticated connection
        of that peer past its cap, or of anyone at the global cap, is closed for it. False
        when every connection is authenticated and the cap is reached."""
        mine = self._unauthenticated_of.get(peer)
        if mine is not None and len(mine) >= self.limits.unauthenticated_per_peer:
            self._turned_away("over the per-peer cap", peer)
            self._close_early(next(iter(mine)), reset=True)
        if len(self._conns) < self.limits.connections:
            return True
        if not self._unauthenticated:
            return False
        oldest = next(iter(self._unauthenticated))
        self._turned_away("at the connection cap", oldest.peer)
        self._close_early(oldest, reset=True)
        return True

    def _first_bytes(self, conn: _Conn) -> None:
        """Read the first frame's length and header, exactly (never into its body), and judge
        it: refused, or authentic and handed to a task."""
        want = 4 if len(conn.buf) < 4 else 4 + _header_size(conn.buf[:4])
        try:
            data = conn.sock.recv(want - len(conn.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_early(conn)
            return
        if not data:  # the peer closed
            self._close_early(conn)
            return
        conn.buf += data
        try:
            if len(conn.buf) == 4:
                _header_size(conn.buf)  # a refusal now, not once the bytes arrive
                return
            if len(conn.buf) < want:
                return
            header = _parse_header(bytes(conn.buf[4:]))
        except LinkError as exc:
            self._turned_away(str(exc), conn.peer)
            self._close_early(conn, refusal=str(exc))
            return
        why = self._fresh(header)
        if why is not None:
            self._turned_away(f"refused a request: {why}", conn.peer)
            self._close_early(conn, refusal=why)
            return
        asyncio.get_running_loop().remove_reader(conn.fd)
        self._authenticated(conn)
        conn.buf = bytearray()
        conn.task = asyncio.get_running_loop().create_task(self._serve(conn, header))

    def _sweep(self) -> None:
        """Close what has not authenticated in time (oldest first: stop at the first young)."""
        now = time.monotonic()
        while self._unauthenticated:
            conn = next(iter(self._unauthenticated))
            if now - conn.since < self.limits.auth_seconds:
                break
            self._turned_away(f"no request within {self.limits.auth_seconds:g} s", conn.peer)
            self._close_early(conn, reset=True)
        self._sweeper = asyncio.get_running_loop().call_later(self._sweep_every, self._sweep)

    def _close_early(self, conn: _Conn, *, refusal: str = "", reset: bool = False) -> None:
        """Close an unauthenticated connection now: its descriptor is free when this returns."""
        asyncio.get_running_loop().remove_reader(conn.fd)
        self._conns.discard(conn)
        self._authenticated(conn)
        if refusal:  # unsigned: whoever sent it is trusted with nothing but the refusal
            with contextlib.suppress(OSError):
                conn.sock.send(_refusal(refusal))
                # A close with unread input is a reset, which can cost the peer the refusal:
                # take what already arrived (a small body), not what a large one still sends.
                for _ in range(DRAIN_READS):
                    if not conn.sock.recv(1 << 16):
                        break
        if reset:
            _reset(conn.sock)
        else:
            conn.sock.close()

    def _authenticated(self, conn: _Conn) -> None:
        self._unauthenticated.pop(conn, None)
        mine = self._unauthenticated_of.get(conn.peer)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._unauthenticated_of[conn.peer]

    def _pause_accepting(self) -> None:
        loop = asyncio.get_running_loop()
        if self._sock is None:
            return
        fd = self._sock.fileno()
        loop.remove_reader(fd)

        def resume() -> None:
            if self._sock is not None and self._sock.fileno() == fd:
                loop.add_reader(fd, self._accept)

        loop.call_later(ACCEPT_PAUSE_SECONDS, resume)

    def _turned_away(self, why: str, peer: str) -> None:
        """Counted; one line at most every LOG_EVERY_SECONDS, whatever a flood sends."""
        self.refused[why] += 1
        now = time.monotonic()
        if now >= self._log_after:
            self._log_after = now + LOG_EVERY_SECONDS
            log.warning(
                "internal channel: turned away a connection from %s: %s (since start: %s)",
                peer,
                why,
                ", ".join(f"{n} {w}" for w, n in self.refused.most_common()),
            )

    def _fresh(self, header: dict[str, Any]) -> str | None:
        """Why the request must be refused (None: it is authentic, fresh and for us)."""
        if header.get("v") != VERSION:
            return "unknown version"
        if not _verify(self.key, _REQ, header):
            return "bad signature"
        if header.get("to") != self.host or header.get("instance") != self.instance:
            return "addressed to another host or an earlier process of this one"
        ts = header.get("ts")
        now = time.time()
        if not isinstance(ts, (int, float)) or abs(now - ts) > SKEW_SECONDS:
            return "outside the time window"
        nonce = header.get("nonce")
        if not isinstance(nonce, str) or len(nonce) != 32:
            return "bad nonce"
        while self._seen:  # insertion order is expiry order: each entry gets now + 2 skews
            old, until = next(iter(self._seen.items()))
            if until >= now:
                break
            del self._seen[old]
        if nonce in self._seen:
            return "replayed"
        self._seen[nonce] = now + 2 * SKEW_SECONDS
        return None

    # once authenticated: a task with streams -----------------------------------------------
    async def _serve(self, conn: _Conn, header: dict[str, Any]) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_connection(sock=conn.sock)
            while True:
                body = await reader.readexactly(header["body_len"])
                if _sha(body) != header.get("body_sha256"):
                    await self._refuse(writer, "the body does not match its signed hash")
                    return
                writer.write(await self._answer(header, body))
                await writer.drain()
                try:
                    async with asyncio.timeout(SERVER_IDLE_SECONDS):
                        header = await _read_header(reader)
                except TimeoutError:
                    return
                except LinkError as exc:
                    await self._refuse(writer, str(exc))
                    return
                why = self._fresh(header)
                if why is not None:
                    self._turned_away(f"refused a request: {why}", conn.peer)
                    await self._refuse(writer, why)
                    return
        except (asyncio.IncompleteReadError, OSError):  # the peer went, or its socket failed
            return
        except asyncio.CancelledError:
            # The server is closing: end this connection quietly (a task that ends cancelled
            # is logged by asyncio as an error, with a traceback).
            return
        finally:
            self._conns.discard(conn)
            if writer is None:
                conn.sock.close()
            else:
                writer.close()  # after what is still buffered (a refusal, an answer's tail)

    async def exchange(self, frame: bytes) -> bytes:
        """Answer one whole request frame handed over in this process (the in-memory
        transport's way in): judged as a connection's frames are, refused unsigned the same."""
        try:
            header, body = split_frame(frame)
        except LinkError as exc:
            return _refusal(str(exc))
        why = self._fresh(header)
        if why is not None:
            self._turned_away(f"refused a request: {why}", "in-process")
            return _refusal(why)
        if _sha(body) != header.get("body_sha256"):
            return _refusal("the body does not match its signed hash")
        return await self._answer(header, body)

    async def _refuse(self, writer: asyncio.StreamWriter, why: str) -> None:
        # Unsigned: whoever sent it cannot be trusted with anything but the refusal.
        with contextlib.suppress(Exception):
            writer.write(_refusal(why))
            await writer.drain()

    async def _answer(self, header: dict[str, Any], body: bytes) -> bytes:
        op = str(header.get("op", ""))
        args = header.get("args")
        status: int = 200
        problem: dict[str, Any] | None = None
        result: dict[str, Any] = {}
        out = b""
        try:
            result, out = await self.handler(op, args if isinstance(args, dict) else {}, body)
        except errors.EphemeralError as exc:
            status, problem = exc.status, exc.to_problem()
        except Exception as exc:
            log.exception("internal channel: %s failed", op)
            status = 500
            problem = errors.EphemeralError(f"{op} failed on host {self.host}: {exc}").to_problem()
        resp = {
            "v": VERSION,
            "re": header["nonce"],
            "from": self.host,
            "status": status,
            "problem": problem,
            "result": result,
            "body_len": len(out),
            "body_sha256": _sha(out),
        }
        resp["sig"] = _sign(self.key, _RESP, resp)
        return _frame(resp, out)


class Expect:
    """What the answer to one request must be: signed by the key over this request's nonce,
    and its body the one its header names. A transport asks it of the header before it reads
    the body, and of the body once read."""

    def __init__(self, key: bytes, peer: Peer, nonce: str) -> None:
        self.key, self.peer, self.nonce = key, peer, nonce

    def header(self, resp: dict[str, Any]) -> None:
        if "refused" in resp:
            raise LinkRefused(f"host {self.peer.host} refused the request: {resp['refused']}")
        if not _verify(self.key, _RESP, resp) or resp.get("re") != self.nonce:
            raise LinkError(f"host {self.peer.host} answered without a valid signature")

    def body(self, resp: dict[str, Any], out: bytes) -> None:
        if _sha(out) != resp.get("body_sha256"):
            raise LinkError(f"host {self.peer.host}'s answer does not match its hash")


class Transport(Protocol):
    """Moves one signed request frame to the host at ``address`` and its answer back (in the
    manner of httpx's ``BaseTransport``): the :class:`LinkClient` signs and checks, a transport
    only carries bytes. :class:`TCPTransport` is the real one; tests use
    ``ephemeral.testing.hostlink.MemoryTransport``, which hands the frame to a
    :class:`LinkServer` in this process. Failing to reach the host is an ``OSError``."""

    async def exchange(
        self, address: str, frame: bytes, expect: Expect
    ) -> tuple[dict[str, Any], bytes]: ...

    def forget(self, address: str) -> None: ...

    async def close(self) -> None: ...


class TCPTransport:
    """A few pooled TCP connections per host."""

    def __init__(self) -> None:
        self._idle: dict[str, deque[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    async def exchange(
        self, address: str, frame: bytes, expect: Expect
    ) -> tuple[dict[str, Any], bytes]:
        reader, writer = await self._connect(address)
        try:
            writer.write(frame)
            await writer.drain()
            resp = await _read_header(reader)
            expect.header(resp)
            out = await reader.readexactly(resp["body_len"])
            expect.body(resp, out)
        except BaseException:
            writer.close()
            raise
        self._release(address, reader, writer)
        return resp, out

    async def _connect(self, address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        idle = self._idle.get(address)
        now = time.monotonic()
        while idle:
            at, reader, writer = idle.pop()
            if now - at < CLIENT_IDLE_SECONDS and not reader.at_eof():
                return reader, writer
            writer.close()
        host, _, port = address.rpartition(":")
        async with asyncio.timeout(CONNECT_SECONDS):
            return await asyncio.open_connection(host.strip("[]"), int(port))

    def _release(
        self, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        idle = self._idle.setdefault(address, deque())
        if len(idle) >= POOL_PER_HOST:
            writer.close()
            return
        idle.append((time.monotonic(), reader, writer))

    def forget(self, address: str) -> None:
        """Close the idle connections to a host (it restarted, or stopped answering)."""
        for _, _, writer in self._idle.pop(address, deque()):
            writer.close()

    async def close(self) -> None:
        for address in list(self._idle):
            self.forget(address)


class LinkClient:
    """An API process's end: signed calls to hosts, over ``transport`` (TCP by default)."""

    def __init__(self, key: bytes, sender: str, transport: Transport | None = None) -> None:
        self.key = key
        self.sender = sender
        self.transport: Transport = transport if transport is not None else TCPTransport()

    async def call(
        self,
        peer: Peer,
        op: str,
        args: dict[str, Any],
        body: bytes = b"",
        *,
        timeout: float,
    ) -> tuple[dict[str, Any], bytes]:
        """Ask ``peer`` to do ``op``; its result and body. A problem it answered is raised as
        the error it names; an unreachable, silent or unauthentic host as :class:`LinkError`."""
        check_peer_address(peer.address)
        nonce = secrets.token_hex(16)
        header = {
            "v": VERSION,
            "op": op,
            "args": args,
            "from": self.sender,
            "to": peer.host,
            "instance": peer.instance,
            "ts": time.time(),
            "nonce": nonce,
            "body_len": len(body),
            "body_sha256": _sha(body),
        }
        header["sig"] = _sign(self.key, _REQ, header)
        try:
            async with asyncio.timeout(timeout):
                resp, out = await self.transport.exchange(
                    peer.address, _frame(header, body), Expect(self.key, peer, nonce)
                )
        except TimeoutError as exc:
            raise LinkError(f"host {peer.host} did not answer within {timeout:.0f} s") from exc
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise LinkError(f"host {peer.host} is unreachable: {type(exc).__name__}") from exc
        if resp.get("status") != 200:
            problem = resp.get("problem") or {}
            slug = str(problem.get("type", "")).rsplit("/", 1)[-1] or None
            cls = errors.error_for(int(resp.get("status", 500)), slug)
            raise cls(
                str(problem.get("detail", "failed on the host")), errors=problem.get("errors")
            )
        result = resp.get("result")
        return (result if isinstance(result, dict) else {}), out

    def forget(self, address: str) -> None:
        """Close the idle connections to a host (it restarted, or stopped answering)."""
        self.transport.forget(address)

    async def close(self) -> None:
        await self.transport.close()


def check_peer_address(address: str) -> None:
    """The API connects only to loopback or private addresses, whatever a directory row says."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise LinkError(f"{address!r} is not ip:port")
    try:
        check_bind_address(host.strip("[]"))
    except errors.InvalidRequest as exc:
        raise LinkError(f"will not connect to {address}: {exc.detail}") from exc
