"""The egress proxy: what code inside the sandbox reaches, decided and dialled by the host.

Each connection made inside the sandbox to the forwarder (``http_proxy``) arrives here as a
:class:`~ephemeral.sandbox.streams.GuestStream`. The first bytes must be one HTTP/1.x request
head, either

- ``CONNECT host:port`` (an HTTPS tunnel; the broker sees the name, never the content: no TLS
  interception), or
- an absolute-form request ``METHOD http://host[:port]/path`` (plain HTTP), or
- an absolute-form request to ``http://NAME.connections.internal/PATH``: a call through the
  run's connection NAME. The broker checks method and path like ``connection_call``, forwards
  only the guest's headers in :data:`CONNECTION_REQUEST_HEADERS`, adds the stored ones and
  makes the request (HTTPS when the connection's base URL is), following no redirect. It asks
  for identity encoding and relays only a whole, unencoded body, with every form of each
  stored secret redacted (``ephemeral.broker.redact``).

Web requests and tunnels pass the same checks as ``web_fetch``: web on, the host allowed by
``web: {"allow": [...]}`` when set (an IP literal never is), resolved once with every address
checked (``ssrf.resolve``; the operator's ``egress_allow_private`` hosts and networks pass),
then dialled at the checked address. Each is charged
``web.per_request_micros`` before it is dialled, and ``web.per_mib_micros`` a MiB ahead of the
bytes moved either way; a charge that does not fit the budget cuts every stream and stops the
run (``budget_exhausted``). A refusal answers ``403`` with a plain-text reason inside and
records ``web.denied``/``connection.denied`` outside.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from ephemeral import errors
from ephemeral.broker import connections, outbound
from ephemeral.broker.redact import Redactor, redact
from ephemeral.broker.secrets import Sealer
from ephemeral.broker.ssrf import (
    PrivateAllow,
    Refused,
    Target,
    event_reason,
    parse_url,
    port_of,
    resolve_within,
)
from ephemeral.lifecycle import StopRun
from ephemeral.policy import WebAllow

if TYPE_CHECKING:
    from ephemeral.broker.context import BrokerContext
    from ephemeral.providers.base import Usage

HEAD_CAP = 16 * 1024  # a request head larger than this is refused
MAX_HEADERS = 100
CHUNK = 128 * 1024
WINDOW = 1 << 20  # per-stream flow-control window, both ways
# The upstream's read buffer: with asyncio's 64 KiB, every 256 KiB read paused and resumed the
# socket (two epoll changes) before a CHUNK was taken from it.
UPSTREAM_BUFFER = 4 * CHUNK
MIB = 1 << 20
CONNECT_SECONDS = 10.0
CONNECTION_BODY_CAP = 8 * MIB  # a connection response is read whole (to redact it), up to this
CONNECTIONS_SUFFIX = ".connections.internal"
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
        "host",
    }
)
# The request headers a connection call forwards from the guest: content negotiation and
# plain caching only. Anything else (credentials, X-HTTP-Method-Override, X-Original-URL,
# X-Forwarded-*, Range/If-Range, Accept-Encoding) is dropped: a header the upstream honours
# could get around the method/path grant or the framing the redaction depends on.
CONNECTION_REQUEST_HEADERS = frozenset(
    {
        "accept",
        "accept-language",
        "cache-control",
        "content-language",
        "content-type",
        "if-match",
        "if-modified-since",
        "if-none-match",
        "if-unmodified-since",
        "user-agent",
    }
)
_TOKEN = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}$")
_METHOD = re.compile(r"^[A-Z]{1,16}$")

NextSeq = Callable[[], int]


class GuestStream(Protocol):
    """One connection made inside the sandbox (``ephemeral.sandbox.streams.GuestStream``)."""

    sid: int
    eof: bool  # the sandbox side shut its sending half
    closed: bool

    async def read(self, n: int = ...) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


class ModelGateway(Protocol):
    """The model gateway (``ephemeral.broker.gateway.Gateway``), as the proxy and the
    sandbox's owner see it."""

    calls: int
    usage: Usage
    turns: list[dict[str, Any]]  # the assistant turns, in a cassette's shape

    async def aclose(self) -> None: ...

    def serves(self, head: Head, host: str | None) -> bool: ...

    async def handle(self, stream: GuestStream, head: Head, egress: Egress) -> None: ...


class _Refusal(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _Cut(Exception):
    """A stream the broker ends (byte cap, idle); recorded on the stream's event."""


@dataclass
class Head:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    rest: bytes  # bytes after the head (the start of a body or of a tunnel)

    def header(self, name: str) -> str | None:
        low = name.lower()
        return next((v for k, v in self.headers if k.lower() == low), None)


def parse_head(raw: bytes) -> Head:
    """A request head; _Refusal(400) for anything but a plain HTTP/1.x head."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise _Refusal(400, "not an HTTP/1.x request line")
    method, target = parts[0].decode("latin-1"), parts[1].decode("latin-1")
    if not _METHOD.match(method) or not target or any(ord(c) <= 0x20 for c in target):
        raise _Refusal(400, "malformed request line")
    if len(lines) - 1 > MAX_HEADERS:
        raise _Refusal(400, f"more than {MAX_HEADERS} headers")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.match(name):
            raise _Refusal(400, "malformed header line")
        text = value.strip().decode("latin-1")
        if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in text):
            raise _Refusal(400, "control characters in a header")
        headers.append((name.decode("ascii"), text))
    return Head(method, target, parts[2].decode("ascii"), headers, rest)


def reply(status: int, reason: str, text: str) -> bytes:
    body = text.encode("utf-8", "replace")
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


_REASONS = {
    400: "Bad Request",
    402: "Payment Required",
    403: "Forbidden",
    411: "Length Required",
    502: "Bad Gateway",
}


class Egress:
    """One run's egress proxy (made by :meth:`Broker.egress`)."""

    def __init__(
        self,
        ctx: BrokerContext,
        *,
        next_seq: NextSeq,
        request_micros: int,
        sealer: Sealer,
        allow_private: bool,
        max_bytes: int,
        idle_seconds: float,
        mib_micros: int,
        web_private: PrivateAllow | None = None,
    ) -> None:
        self.ctx = ctx
        self.next_seq = next_seq
        self.request_micros = request_micros
        self.sealer = sealer
        self.allow_private = allow_private
        self.web_private = web_private  # egress_allow_private: web requests only
        self.max_bytes = max_bytes
        self.idle_seconds = idle_seconds
        self.mib_micros = mib_micros
        self.bytes_total = 0
        self.stopped: StopRun | None = None  # set when a charge did not fit: the run must end
        self.failed: str | None = None  # set when the broker itself failed: egress is closed
        self.cut_all: Callable[[], Awaitable[None]] | None = None  # set by whoever owns streams
        self.gateway: ModelGateway | None = None  # http://model.internal/, when models are granted

    # -- one stream -------------------------------------------------------------------------
    async def handle(self, stream: GuestStream) -> None:
        if self.stopped is not None or self.failed is not None:
            return  # egress is closed: the stream is closed unanswered
        try:
            await self._handle(stream)
        except ConnectionError:
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The broker itself failed: fail closed. Every stream is cut, no new one is
            # served, and the run ends at its next step.
            self.failed = self.failed or type(exc).__name__
            if self.cut_all is not None:
                await self.cut_all()
            raise

    async def _handle(self, stream: GuestStream) -> None:
        try:
            head = await self._read_head(stream)
        except _Refusal as exc:
            await stream.write(reply(exc.status, _REASONS[exc.status], exc.reason + "\n"))
            return
        except (TimeoutError, _Cut):
            return
        host = _host_of(head)
        if self.gateway is not None and self.gateway.serves(head, host):
            await self.gateway.handle(stream, head, self)
        elif host is not None and host.lower().endswith(CONNECTIONS_SUFFIX):
            await self._connection(stream, head, host)
        else:
            await self._web(stream, head)

    async def _read_head(self, stream: GuestStream) -> Head:
        buf = bytearray()
        async with asyncio.timeout(self.idle_seconds):
            while b"\r\n\r\n" not in buf:
                if len(buf) > HEAD_CAP:
                    raise _Refusal(400, f"request head larger than {HEAD_CAP} bytes")
                data = await stream.read()
                if not data:
                    raise _Cut("closed before a request")
                self._count(len(data))
                buf += data
        if buf.index(b"\r\n\r\n") > HEAD_CAP:
            raise _Refusal(400, f"request head larger than {HEAD_CAP} bytes")
        return parse_head(bytes(buf))

    def _count(self, n: int) -> None:
        self.bytes_total += n
        if self.bytes_total > self.max_bytes:
            raise _Cut(f"the run's egress byte cap ({self.max_bytes} bytes) is used up")

    # -- web (CONNECT and plain HTTP) -------------------------------------------------------
    async def _web(self, stream: GuestStream, head: Head) -> None:
        event: dict[str, Any] = {"method": head.method, "host": "", "port": 0}
        try:
            target = self._web_target(head, event)
            policy = self.ctx.policy
            if not policy.web_on:
                raise _Refusal(403, "web access is off in this run's policy")
            if isinstance(policy.web, WebAllow) and not policy.web.allows(target.host):
                raise _Refusal(403, f"host {target.host!r} is not in the run's web allow list")
            try:
                checked = await resolve_within(
                    target,
                    CONNECT_SECONDS,
                    allow_private=self.allow_private,
                    allowed=self.web_private,
                )
            except Refused as exc:
                raise _Refusal(403, exc.reason) from None
        except _Refusal as exc:
            reason = event_reason(exc.reason, zdr=self.ctx.policy.zero_data_retention)
            await self.ctx.emit("web.denied", {**event, "reason": reason, "cost_micros": 0})
            await stream.write(reply(exc.status, _REASONS[exc.status], exc.reason + "\n"))
            return
        # httpx drops a scheme's default port (CONNECT h:443 parses as https://h/): the port
        # dialled, and recorded, is the one asked for or the scheme's default.
        port = port_of(target)
        meter = _Meter(self, stream.sid)
        event.update(port=port, status=None, bytes_in=0, bytes_out=0)
        cut: str | None = None
        try:
            await meter.open()
            try:
                async with asyncio.timeout(CONNECT_SECONDS):
                    up_r, up_w = await asyncio.open_connection(
                        str(checked.address), port, limit=UPSTREAM_BUFFER
                    )
            except (OSError, TimeoutError):
                event["status"] = 502
                await stream.write(reply(502, "Bad Gateway", "cannot reach the host\n"))
                return
            try:
                if head.method == "CONNECT":
                    event["status"] = 200
                    await stream.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    first = head.rest
                else:
                    first = _forward_head(head, target)
                    body = await self._request_body(stream, head)
                    first += body
                    head.rest = b""
                await self._pipe(stream, up_r, up_w, meter, first, event, head)
            finally:
                up_w.close()
                with contextlib.suppress(OSError, asyncio.CancelledError, TimeoutError):
                    await asyncio.wait_for(up_w.wait_closed(), 1.0)
        except _Refusal as exc:
            cut = exc.reason
            with contextlib.suppress(ConnectionError):
                await stream.write(reply(exc.status, _REASONS[exc.status], exc.reason + "\n"))
        except _Cut as exc:
            cut = str(exc)
        except StopRun as exc:
            cut = "the run's budget is used up"
            if event.get("status") is None:  # nothing answered yet: the client reads why
                with contextlib.suppress(ConnectionError):
                    await stream.write(reply(402, _REASONS[402], cut + "\n"))
            await self._stop(exc)
        except (ConnectionError, OSError, TimeoutError):
            pass
        except Exception as exc:
            # The broker itself failed: mark it before the stream closes, so the connection
            # the client makes next is already refused.
            self.failed = self.failed or type(exc).__name__
            raise
        finally:
            # The client's wait ends with the stream, not with the bookkeeping.
            await stream.close()
            event.update(bytes_in=meter.bytes_in, bytes_out=meter.bytes_out, cost_micros=meter.cost)
            if cut:
                event["cut"] = cut
            # with the request's charges, in their batch: one transaction for both
            self.ctx.record_event("web.requested", event)

    def _web_target(self, head: Head, event: dict[str, Any]) -> httpx.URL:
        """The URL a request or tunnel asks for (recorded into ``event``); _Refusal(400) when
        it is not one the proxy serves."""
        if head.method == "CONNECT":
            host, sep, port = head.target.rpartition(":")
            host = host.strip("[]")
            event.update(host=host[:253] or head.target[:253])
            if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
                raise _Refusal(400, "CONNECT needs host:port")
            event["port"] = int(port)
            try:
                url = parse_url(f"https://{_bracket(host)}:{port}/")
            except Refused as exc:
                raise _Refusal(400, exc.reason) from None
            return url
        if not head.target.lower().startswith("http://"):
            raise _Refusal(
                400,
                "send plain HTTP as an absolute-form proxy request, and HTTPS through CONNECT "
                "(set http_proxy/https_proxy)",
            )
        try:
            url = parse_url(head.target)
        except Refused as exc:
            raise _Refusal(400, exc.reason) from None
        event.update(host=url.host, port=url.port or 80, path=url.path[:1024])
        _body_length(head)  # framing is checked before anything is resolved or charged
        return url

    async def _request_body(self, stream: GuestStream, head: Head) -> bytes:
        """The request body, by Content-Length (chunked request bodies are refused), so nothing
        the guest sends after it reaches the upstream unchecked."""
        want = _body_length(head)
        body = bytearray(head.rest[:want])
        while len(body) < want:
            async with asyncio.timeout(self.idle_seconds):
                data = await stream.read(min(CHUNK, want - len(body)))
            if not data:
                raise _Cut("closed mid-body")
            self._count(len(data))
            body += data
        return bytes(body)

    async def _pipe(
        self,
        stream: GuestStream,
        up_r: asyncio.StreamReader,
        up_w: asyncio.StreamWriter,
        meter: _Meter,
        first: bytes,
        event: dict[str, Any],
        head: Head,
    ) -> None:
        tunnel = head.method == "CONNECT"
        last = [time.monotonic()]
        if first:
            await meter.take(len(first), out=True)
            up_w.write(first)
            await up_w.drain()

        async def inward() -> None:  # sandbox -> upstream (tunnels only)
            while True:
                data = await stream.read()
                if not data:
                    if stream.eof and not stream.closed:
                        with contextlib.suppress(OSError):
                            up_w.write_eof()
                        return
                    raise _Cut("closed by the sandbox")
                self._count(len(data))
                await meter.take(len(data), out=True)
                last[0] = time.monotonic()
                up_w.write(data)
                await up_w.drain()

        async def outward() -> None:  # upstream -> sandbox
            status_line = bytearray()
            # A plain-HTTP response's head, held until whole: it goes on saying Connection:
            # close (see _close_response_head); a tunnel's bytes are not HTTP to us.
            held: bytearray | None = None if tunnel else bytearray()
            while True:
                data = await up_r.read(CHUNK)
                if not data:
                    if held:
                        await stream.write(bytes(held))
                    return
                self._count(len(data))
                await meter.take(len(data), out=False)
                last[0] = time.monotonic()
                if held is not None:
                    held += data
                    raw = len(held)
                    out = bytearray()
                    while held is not None:
                        end = held.find(b"\r\n\r\n")
                        if end < 0:
                            if len(held) > HEAD_CAP:  # not a head we read: as it came
                                out += held
                                held = None
                            break
                        head, held = bytes(held[: end + 4]), held[end + 4 :]
                        if re.match(rb"HTTP/1\.[01] 1\d\d ", head):
                            out += head  # an interim head; the final one follows
                            continue
                        out += _close_response_head(head) + held
                        held = None
                    if not out:
                        continue
                    # bytes_in is what the sandbox receives: the rewritten head's length
                    meter.bytes_in += len(out) - (raw - (len(held) if held is not None else 0))
                    data = bytes(out)
                if not tunnel and event.get("status") is None and len(status_line) < 32:
                    status_line += data[:32]
                    event["status"] = _status_of(bytes(status_line))
                await stream.write(data)

        async def watchdog() -> None:
            while True:
                await asyncio.sleep(min(0.2, self.idle_seconds / 4))
                if stream.closed:
                    raise _Cut("closed by the sandbox or the host")
                if time.monotonic() - last[0] > self.idle_seconds:
                    raise _Cut(f"idle for {self.idle_seconds:g} s")

        out_task = asyncio.create_task(outward())
        tasks = {out_task, asyncio.create_task(watchdog())}
        if tunnel:
            tasks.add(asyncio.create_task(inward()))
        try:
            pending = tasks
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                finished = out_task in done or any(
                    t.exception() is not None for t in done if not t.cancelled()
                )
                if finished:
                    break
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            failure = None if t.cancelled() else t.exception()
            if failure is not None:
                raise failure

    async def _stop(self, exc: StopRun) -> None:
        """A charge did not fit: cut every stream; the run ends at its next step."""
        if self.stopped is None:
            self.stopped = exc
            if self.cut_all is not None:
                await self.cut_all()

    # -- connections from code -----------------------------------------------------------------
    async def _connection(self, stream: GuestStream, head: Head, host: str) -> None:
        name = host.lower()[: -len(CONNECTIONS_SUFFIX)]
        method = head.method
        path = ""
        if head.method != "CONNECT" and head.target.lower().startswith("http://"):
            rest = head.target[len("http://") :]
            slash = rest.find("/")
            path = rest[slash:] if slash >= 0 else "/"
        shown = path.split("?", 1)[0][: connections.MAX_PATH_CHARS]

        async def deny(reason: str) -> None:
            await self.ctx.emit(
                "connection.denied",
                {
                    "name": name[:63],
                    "method": method[:16],
                    "path": shown,
                    "reason": event_reason(reason, zdr=self.ctx.policy.zero_data_retention),
                },
            )
            await stream.write(reply(403, "Forbidden", f"connection call refused: {reason}\n"))

        if head.method == "CONNECT":
            plain = f"http://{name}{CONNECTIONS_SUFFIX}/PATH"
            return await deny(f"use {plain!r}; the broker makes the TLS connection")
        try:
            if httpx.URL(head.target).port is not None:
                return await deny("a connection URL takes no port")
        except (httpx.InvalidURL, ValueError):
            return await deny("not a valid URL")
        allowed = next((c for c in self.ctx.policy.connections if c.name == name), None)
        if allowed is None:
            return await deny(f"connection {name!r} is not granted to this run")
        if method not in allowed.methods:
            return await deny(
                f"method {method!r} is not allowed (allowed: {', '.join(allowed.methods)})"
            )
        try:
            connections.check_path(path, allowed)
        except connections.Denied as exc:
            return await deny(exc.reason)
        try:
            body = await self._request_body(stream, head)
        except _Refusal as exc:
            return await deny(exc.reason)
        if len(body) > connections.MAX_BODY_BYTES:
            return await deny(f"body larger than {connections.MAX_BODY_BYTES} bytes")
        try:
            stored = await self.ctx.get_connection(allowed.name)
        except errors.NotFound:
            return await deny(f"connection {allowed.name!r} no longer exists for this org")
        try:
            url = connections.join(stored.base_url, path)
        except connections.Denied as exc:
            return await deny(exc.reason)
        try:
            target = await resolve_within(url, CONNECT_SECONDS, allow_private=self.allow_private)
        except Refused as exc:
            return await deny(exc.reason)
        credentials = self.sealer.open(stored.sealed_headers)
        stored_names = {k.lower() for k in credentials}
        headers = {
            k: v
            for k, v in head.headers
            if k.lower() in CONNECTION_REQUEST_HEADERS and k.lower() not in stored_names
        }
        headers.update(credentials)
        redactor = Redactor(connections._secret_parts(credentials))
        status: int | None = None
        try:
            response = await _send_connection(
                target,
                method,
                headers,
                body or None,
                redactor=redactor,
                timeout=connections.REQUEST_SECONDS,
            )
            status = response[0]
        except (httpx.HTTPError, TimeoutError) as exc:
            await stream.write(
                reply(502, "Bad Gateway", f"the connection call failed: {type(exc).__name__}\n")
            )
            return
        except _Refusal as exc:
            status = exc.status
            await stream.write(reply(502, "Bad Gateway", f"the connection call failed: {exc}\n"))
            return
        finally:
            await self.ctx.emit(
                "connection.requested",
                {"name": allowed.name, "method": method, "path": shown, "status": status},
            )
        code, phrase, out_headers, content = response
        lines = [f"HTTP/1.1 {code} {phrase}"]
        for k, v in out_headers:
            if k.lower() in HOP_BY_HOP or k.lower() in _FRAMING:
                continue
            lines.append(f"{k}: {v}")
        # The head is redacted as one text: a secret may sit in a name, a value or across both.
        shown_head = redact("\r\n".join(lines).encode("latin-1", "replace"), redactor.secrets)
        tail = f"\r\nContent-Length: {len(content)}\r\nConnection: close\r\n\r\n".encode()
        await stream.write(shown_head + tail + content)


class _Meter:
    """Counts a stream's bytes and charges ``web.per_mib_micros`` a MiB before it is used."""

    def __init__(self, egress: Egress, sid: int) -> None:
        self.egress = egress
        self.sid = sid
        self.free = egress.mib_micros == 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.paid = 0
        self.blocks = 0
        self.cost = 0

    async def open(self) -> None:
        """Charge the request or tunnel and its first MiB, in one charge, before dialling."""
        micros = self.egress.request_micros + (0 if self.free else self.egress.mib_micros)
        key = f"web:{self.egress.next_seq()}"
        self.cost += await self.egress.ctx.charge_web_bytes(key, micros)
        if not self.free:
            self.blocks, self.paid = 1, MIB

    async def take(self, n: int, *, out: bool) -> None:
        """Pay for ``n`` more bytes before they move (StopRun when they do not fit)."""
        while not self.free and self.bytes_in + self.bytes_out + n > self.paid:
            price = await self.egress.ctx.charge_web_bytes(
                f"egress:{self.sid}:{self.blocks + 1}", self.egress.mib_micros
            )
            self.blocks += 1
            self.cost += price
            self.paid += MIB
        if out:
            self.bytes_out += n
        else:
            self.bytes_in += n


def _body_length(head: Head) -> int:
    """The request body's length by Content-Length; chunked or ambiguous framing is refused."""
    if head.header("transfer-encoding") is not None:
        raise _Refusal(411, "chunked request bodies are not supported; send Content-Length")
    lengths = {v.strip() for k, v in head.headers if k.lower() == "content-length"}
    if len(lengths) > 1:
        raise _Refusal(400, "conflicting Content-Length headers")
    raw = head.header("content-length") or "0"
    if not raw.isdigit() or len(raw) > 12:
        raise _Refusal(400, "bad Content-Length")
    return int(raw)


def _host_of(head: Head) -> str | None:
    if head.method == "CONNECT":
        return head.target.rpartition(":")[0].strip("[]") or None
    if head.target.lower().startswith("http://"):
        try:
            return httpx.URL(head.target).host or None
        except (httpx.InvalidURL, ValueError):
            return None
    return None


def _bracket(host: str) -> str:
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]"
    except ValueError:
        pass
    return host


def _forward_head(head: Head, url: httpx.URL) -> bytes:
    target = url.raw_path.decode("ascii") or "/"
    lines = [f"{head.method} {target} HTTP/1.1", f"Host: {url.netloc.decode('ascii')}"]
    dropped = set(HOP_BY_HOP)
    for name in (head.header("connection") or "").split(","):
        dropped.add(name.strip().lower())
    for k, v in head.headers:
        if k.lower() not in dropped:
            lines.append(f"{k}: {v}")
    lines += ["Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1")


def _close_response_head(head: bytes) -> bytes:
    """A plain-HTTP response head as the sandbox gets it: hop-by-hop headers dropped and
    ``Connection: close`` said, because the proxy serves one request per connection. Without it
    an HTTP/1.1 response reads as keep-alive: a client (pip, urllib3) sends its next request on
    the pooled connection the proxy is closing and gets "Remote end closed connection"."""
    lines = head[:-4].split(b"\r\n")
    dropped = {b"connection", b"keep-alive", b"proxy-connection"}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"connection":
            dropped.update(v.strip().lower() for v in value.split(b","))
    kept = [ln for ln in lines[1:] if ln.partition(b":")[0].strip().lower() not in dropped]
    return b"\r\n".join([lines[0], *kept, b"Connection: close", b"", b""])


def _status_of(line: bytes) -> int | None:
    m = re.match(rb"HTTP/1\.[01] (\d{3})", line)
    return int(m.group(1)) if m else None


# Response headers the broker sets itself, or refuses (Content-Encoding, Content-Range).
_FRAMING = frozenset({"content-length", "transfer-encoding", "content-encoding", "content-range"})


def _framing_refusal(status: int, headers: httpx.Headers) -> str | None:
    """Why a connection's response cannot be relayed: a body the broker cannot redact as
    sent (compressed: the secret is not in its bytes), or a part of one (pieces of a secret
    from several ranges join back into it)."""
    codings = [
        c.strip().lower() for v in headers.get_list("content-encoding") for c in v.split(",")
    ]
    coded = [c for c in codings if c not in ("", "identity")]
    if coded:
        return f"the upstream sent Content-Encoding {coded[0][:32]!r}; only identity is relayed"
    if status == 206 or headers.get("content-range") is not None:
        return "the upstream sent a partial response; only whole bodies are relayed"
    return None


async def _send_connection(
    target: Target,
    method: str,
    headers: dict[str, str],
    content: bytes | None,
    *,
    redactor: Redactor,
    timeout: float,
) -> tuple[int, str, list[tuple[str, str]], bytes]:
    """Make the call and read the response whole, redacted as it arrives; _Refusal(502) for
    a response whose framing the broker does not relay."""
    url = target.url
    # The broker's identity wins over anything the guest asked for (it sent none anyway).
    sent = {"Host": url.netloc.decode("ascii"), **headers, "Accept-Encoding": "identity"}
    extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
    async with (
        asyncio.timeout(timeout),
        httpx.AsyncClient(
            trust_env=False,
            follow_redirects=False,
            timeout=httpx.Timeout(timeout),
            verify=outbound._tls(),
        ) as client,
    ):
        token = outbound._SENDING.set(True)
        try:
            request = client.build_request(
                method, target.dial_url, headers=sent, content=content, extensions=extensions
            )
            response = await client.send(request, stream=True)
            try:
                why = _framing_refusal(response.status_code, response.headers)
                if why is not None:
                    raise _Refusal(502, why)
                body = bytearray()
                read = 0
                async for chunk in response.aiter_raw():
                    read += len(chunk)
                    if read > CONNECTION_BODY_CAP:
                        raise httpx.ReadError("the response is larger than the broker's cap")
                    body += redactor.feed(chunk)
                body += redactor.finish()
                return (
                    response.status_code,
                    response.reason_phrase or "",
                    [(k, v) for k, v in response.headers.multi_items()],
                    bytes(body),
                )
            finally:
                await response.aclose()
        finally:
            outbound._SENDING.reset(token)
