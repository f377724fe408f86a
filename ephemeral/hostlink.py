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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ephemeral import errors

log = logging.getLogger("ephemeral.hostlink")

VERSION = 1
MAX_HEADER = 64 << 10
MAX_BODY = 160 << 20  # a 128 MiB file plus room; an exec's output is far less
SKEW_SECONDS = 30.0  # a request older or newer than this (by the host's clock) is refused
SERVER_IDLE_SECONDS = 60.0
# A pooled connection idle longer than this is not reused: well under the server's idle close,
# so an end of stream on a reused connection is a real failure, never a race with that close.
CLIENT_IDLE_SECONDS = 20.0
POOL_PER_HOST = 16
CONNECT_SECONDS = 5.0
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


def _canon(header: dict[str, Any]) -> bytes:
    return json.dumps(
        {k: v for k, v in header.items() if k != "sig"}, sort_keys=True, separators=(",", ":")
    ).encode()


def _sign(key: bytes, label: bytes, header: dict[str, Any]) -> str:
    return hmac.new(key, label + _canon(header), hashlib.sha256).hexdigest()


def _verify(key: bytes, label: bytes, header: dict[str, Any]) -> bool:
    sig = header.get("sig")
    return isinstance(sig, str) and hmac.compare_digest(sig, _sign(key, label, header))


async def _read_header(reader: asyncio.StreamReader) -> dict[str, Any]:
    """A frame's header; its ``body_len`` bytes follow, read by the caller once it trusts it."""
    (size,) = struct.unpack(">I", await reader.readexactly(4))
    if not 0 < size <= MAX_HEADER:
        raise LinkError(f"a frame header of {size} bytes (the cap is {MAX_HEADER})")
    try:
        header = json.loads(await reader.readexactly(size))
    except (UnicodeDecodeError, ValueError) as exc:
        raise LinkError("a frame header that is not JSON") from exc
    if not isinstance(header, dict):
        raise LinkError("a frame header that is not an object")
    body_len = header.get("body_len", 0)
    if not isinstance(body_len, int) or isinstance(body_len, bool) or not 0 <= body_len <= MAX_BODY:
        raise LinkError(f"a frame body of {body_len!r} bytes (the cap is {MAX_BODY})")
    return header


def _frame(header: dict[str, Any], body: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack(">I", len(raw)) + raw + body


def _sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


@dataclass(frozen=True)
class Peer:
    """Where a host's channel listens, and which process of it is there now."""

    host: str
    address: str  # "ip:port"
    instance: str


class LinkServer:
    """A host's end: verifies each request, hands it to ``handler(op, args, body)`` and signs
    the answer. A handler's :class:`~ephemeral.errors.EphemeralError` goes back as a problem."""

    def __init__(self, key: bytes, host: str, handler: Handler) -> None:
        self.key = key
        self.host = host
        self.instance = secrets.token_hex(16)
        self.handler = handler
        self._seen: dict[str, float] = {}  # nonce -> when it expires from the window
        self._server: asyncio.Server | None = None
        self.address = ""
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self, address: str, port: int = 0) -> str:
        bind = check_bind_address(address)
        self._server = await asyncio.start_server(self._serve, bind, port)
        sock = self._server.sockets[0].getsockname()
        self.address = f"[{sock[0]}]:{sock[1]}" if ":" in sock[0] else f"{sock[0]}:{sock[1]}"
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._conns):
                task.cancel()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        try:
            while True:
                try:
                    async with asyncio.timeout(SERVER_IDLE_SECONDS):
                        header = await _read_header(reader)
                except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    return
                except LinkError as exc:
                    await self._refuse(writer, str(exc))
                    return
                why = self._fresh(header)
                if why is not None:
                    log.warning("internal channel: refused a request: %s", why)
                    await self._refuse(writer, why)
                    return
                body = await reader.readexactly(header["body_len"])
                if _sha(body) != header.get("body_sha256"):
                    await self._refuse(writer, "the body does not match its signed hash")
                    return
                answer = await self._answer(header, body)
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        except asyncio.CancelledError:
            # The server is closing: end this connection quietly (a handler task that ends
            # cancelled is logged by asyncio as an error, with a traceback).
            return
        finally:
            if task is not None:
                self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _refuse(self, writer: asyncio.StreamWriter, why: str) -> None:
        # Unsigned: whoever sent it cannot be trusted with anything but the refusal.
        with contextlib.suppress(Exception):
            writer.write(_frame({"v": VERSION, "refused": why, "body_len": 0}, b""))
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


class LinkClient:
    """An API process's end: signed calls to hosts, over a few pooled connections each."""

    def __init__(self, key: bytes, sender: str) -> None:
        self.key = key
        self.sender = sender
        self._idle: dict[str, deque[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]]] = {}

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
                reader, writer = await self._connect(peer.address)
                try:
                    writer.write(_frame(header, body))
                    await writer.drain()
                    resp = await _read_header(reader)
                    if "refused" in resp:
                        raise LinkRefused(
                            f"host {peer.host} refused the request: {resp['refused']}"
                        )
                    if not _verify(self.key, _RESP, resp) or resp.get("re") != nonce:
                        raise LinkError(f"host {peer.host} answered without a valid signature")
                    out = await reader.readexactly(resp["body_len"])
                    if _sha(out) != resp.get("body_sha256"):
                        raise LinkError(f"host {peer.host}'s answer does not match its hash")
                except BaseException:
                    writer.close()
                    raise
        except TimeoutError as exc:
            raise LinkError(f"host {peer.host} did not answer within {timeout:.0f} s") from exc
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise LinkError(f"host {peer.host} is unreachable: {type(exc).__name__}") from exc
        self._release(peer.address, reader, writer)
        if resp.get("status") != 200:
            problem = resp.get("problem") or {}
            slug = str(problem.get("type", "")).rsplit("/", 1)[-1] or None
            cls = errors.error_for(int(resp.get("status", 500)), slug)
            raise cls(
                str(problem.get("detail", "failed on the host")), errors=problem.get("errors")
            )
        result = resp.get("result")
        return (result if isinstance(result, dict) else {}), out

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


def check_peer_address(address: str) -> None:
    """The API connects only to loopback or private addresses, whatever a directory row says."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise LinkError(f"{address!r} is not ip:port")
    try:
        check_bind_address(host.strip("[]"))
    except errors.InvalidRequest as exc:
        raise LinkError(f"will not connect to {address}: {exc.detail}") from exc
