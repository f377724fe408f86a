"""A Dockerfile build's network: a namespace whose only way out is a proxy that admits the
operator's allow list (setting ``build_allow_hosts``), every request recorded.

With an allow list set, each build sandbox gets a network namespace of its own holding only a
loopback interface, on which host root (a thread of the builder that enters the namespace for
the time of a ``bind``) listens at :data:`PROXY`. Every command of the build runs in that
namespace with ``http_proxy``/``https_proxy`` (both spellings) pointing there; nothing else
listens and there is no route out, so a command that ignores the variables reaches nothing.

The proxy takes what the egress proxy of runs takes (``ephemeral/broker/egress.py``, whose
request parsing it uses): ``CONNECT host:port`` (a tunnel; no TLS interception) and plain
HTTP in absolute form. The host must match the allow list (host names and ``*.`` patterns, as
``web: {"allow": [...]}``: an IP literal never matches), then it is resolved once and every
address checked by the SSRF rules (``ephemeral/broker/ssrf.py``: loopback and private
addresses only with ``broker_allow_private_hosts`` or the operator's ``egress_allow_private``
hosts and networks, link-local and reserved never unless listed there), and the checked
address is dialled. It lives beside the sandbox layer, not in it: it is made of the broker's
egress parts, which the sandbox does not import.

A refusal answers ``403`` with the reason in the body. Each request is recorded (method, host,
port, bytes each way, allowed or the reason refused): no path, query or header, so nothing a
URL carries is kept. A build moves at most :data:`MAX_BYTES` through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import os
import socket
import struct
import threading
from typing import Any

from ephemeral.broker.egress import (
    HEAD_CAP,
    Head,
    _close_response_head,
    _forward_head,
    _Refusal,
    parse_head,
    reply,
)
from ephemeral.broker.egress import _body_length as body_length
from ephemeral.broker.ssrf import PrivateAllow, Refused, parse_url, port_of, resolve_within
from ephemeral.policy import WebAllow
from ephemeral.settings import Settings

PROXY = ("127.0.0.1", 3128)
MAX_BYTES = 8 << 30
IDLE_S = 120.0
CONNECT_S = 10.0
CHUNK = 1 << 16
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def for_build(settings: Settings) -> BuildProxy | None:
    """The proxy of a build under ``settings``, or None: no allow list, no network."""
    if not settings.build_allow_hosts:
        return None
    return BuildProxy(
        WebAllow(allow=list(settings.build_allow_hosts)),
        allow_private=settings.broker_allow_private_hosts,
        private=PrivateAllow.of(settings.egress_allow_private),
    )


def _listen_in(netns: str) -> socket.socket:
    """In a thread of its own (a namespace is per thread): enter ``netns``, bring its loopback
    up, bind the proxy's socket there, come back. The socket stays in that namespace."""
    out: list[socket.socket | OSError] = []

    def work() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        there = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if libc.setns(there, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns into the build's network")
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    req = struct.pack("16sH14x", b"lo", 0)
                    flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
                    fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.bind(PROXY)
                sock.listen(64)
                sock.setblocking(False)
                out.append(sock)
            finally:
                if libc.setns(home, _CLONE_NEWNET) != 0:  # the thread ends anyway
                    raise OSError(ctypes.get_errno(), "setns back")
        except OSError as exc:  # handed to the caller's thread
            out.append(exc)
        finally:
            os.close(home)
            os.close(there)

    t = threading.Thread(target=work, name="build-proxy-netns")
    t.start()
    t.join()
    if not out:
        raise OSError("the build's proxy could not listen in its network")
    got = out[-1]
    if isinstance(got, OSError):
        for s in out[:-1]:
            if isinstance(s, socket.socket):
                s.close()
        raise got
    return got


class BuildProxy:
    """One build's proxy: a :class:`~ephemeral.sandbox.build_sandbox.NetHook`. ``records``
    holds a dict per request, in the order they ended."""

    def __init__(
        self, allow: WebAllow, *, allow_private: bool, private: PrivateAllow | None = None
    ) -> None:
        self.allow = allow
        self.allow_private = allow_private
        self.private = private
        self.records: list[dict[str, Any]] = []
        self.bytes_total = 0
        self._holder: asyncio.subprocess.Process | None = None
        self._server: asyncio.Server | None = None

    def env(self) -> dict[str, str]:
        url = f"http://{PROXY[0]}:{PROXY[1]}"
        return {k: url for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}

    def denied(self, since: int = 0) -> list[dict[str, Any]]:
        return [r for r in self.records[since:] if not r["allowed"]]

    async def start(self) -> str:
        if self._server is not None:
            assert self._holder is not None
            return f"/proc/{self._holder.pid}/ns/net"
        self._holder = await asyncio.create_subprocess_exec(
            "unshare", "--net", "--", "sleep", "infinity",
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        path = f"/proc/{self._holder.pid}/ns/net"
        mine = os.readlink("/proc/self/ns/net")
        for _ in range(2000):  # until the holder has unshared
            with contextlib.suppress(OSError):
                if os.readlink(path) != mine:
                    break
            await asyncio.sleep(0.005)
        else:
            await self.stop()
            raise OSError("the build's network namespace was not made")
        sock = await asyncio.to_thread(_listen_in, path)
        self._server = await asyncio.start_server(self._serve, sock=sock, limit=CHUNK)
        return path

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None
        if self._holder is not None:
            with contextlib.suppress(ProcessLookupError):
                self._holder.kill()
            await self._holder.wait()
            self._holder = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rec: dict[str, Any] = {"method": "", "host": "", "port": 0, "allowed": False}
        counts = [0, 0]  # to the host, from the host
        try:
            await self._one(reader, writer, rec, counts)
        except (ConnectionError, OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            rec.update(bytes_out=counts[0], bytes_in=counts[1])
            self.records.append(rec)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1)

    async def _one(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        rec: dict[str, Any],
        counts: list[int],
    ) -> None:
        try:
            head = await self._head(reader)
            rec["method"] = head.method
            url, port = self._target(head, rec)
            if not self.allow.allows(url.host):
                raise _Refusal(
                    403, f"host {url.host!r} is not in the build's allow list (build_allow_hosts)"
                )
            try:
                checked = await resolve_within(
                    url,
                    CONNECT_S,
                    allow_private=self.allow_private,
                    allowed=self.private,
                    timeout_reason=f"timed out resolving {url.host!r}",
                )
            except Refused as exc:
                raise _Refusal(403, exc.reason) from None
            try:
                async with asyncio.timeout(CONNECT_S):
                    up_r, up_w = await asyncio.open_connection(str(checked.address), port)
            except (OSError, TimeoutError):
                rec["reason"] = "cannot reach the host"
                writer.write(reply(502, "Bad Gateway", "cannot reach the host\n"))
                return
        except _Refusal as exc:
            rec["reason"] = exc.reason
            writer.write(reply(exc.status, "Forbidden" if exc.status == 403 else "Bad Request",
                               f"ephemeral build proxy: {exc.reason}\n"))  # fmt: skip
            await writer.drain()
            return
        rec["allowed"] = True
        try:
            if head.method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                first = head.rest
                up_w.write(first)
                counts[0] += len(first)
                await asyncio.gather(
                    self._copy(reader, up_w, counts, 0), self._copy(up_r, writer, counts, 1)
                )
            else:
                want = body_length(head)
                body = head.rest[:want]
                if len(body) < want:
                    body += await reader.readexactly(want - len(body))
                up_w.write(_forward_head(head, url) + body)
                counts[0] += want
                raw = await asyncio.wait_for(up_r.readuntil(b"\r\n\r\n"), IDLE_S)
                counts[1] += len(raw)
                writer.write(_close_response_head(raw))
                await self._copy(up_r, writer, counts, 1)
        finally:
            up_w.close()

    async def _head(self, reader: asyncio.StreamReader) -> Head:
        try:
            raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IDLE_S)
        except asyncio.LimitOverrunError:
            raise _Refusal(400, f"request head larger than {CHUNK} bytes") from None
        if len(raw) > HEAD_CAP:
            raise _Refusal(400, f"request head larger than {HEAD_CAP} bytes")
        return parse_head(raw)

    def _target(self, head: Head, rec: dict[str, Any]) -> tuple[Any, int]:
        try:
            if head.method == "CONNECT":
                host, sep, port = head.target.rpartition(":")
                host = host.strip("[]")
                rec.update(host=host[:253], port=int(port) if port.isdigit() else 0)
                if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
                    raise _Refusal(400, "CONNECT needs host:port")
                host = f"[{host}]" if ":" in host else host
                url = parse_url(f"https://{host}:{port}/")
            elif head.target.lower().startswith("http://"):
                url = parse_url(head.target)
                rec.update(host=url.host[:253], port=port_of(url))
                body_length(head)  # framing is checked before anything is dialled
            else:
                raise _Refusal(400, "send HTTP in absolute form, HTTPS by CONNECT")
        except Refused as exc:
            raise _Refusal(400, exc.reason) from None
        return url, port_of(url)

    async def _copy(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, counts: list[int], k: int
    ) -> None:
        while True:
            data = await asyncio.wait_for(src.read(CHUNK), IDLE_S)
            if not data:
                with contextlib.suppress(OSError):
                    if dst.can_write_eof():
                        dst.write_eof()
                return
            counts[k] += len(data)
            self.bytes_total += len(data)
            if self.bytes_total > MAX_BYTES:
                raise ConnectionError(f"the build's network moved more than {MAX_BYTES} bytes")
            dst.write(data)
            await dst.drain()
