"""Where the broker may send a request: URL shape checks and address classes (SSRF guard).

The broker resolves a host once, refuses it if *any* of its addresses is not a public unicast
address, and then connects to the address it checked (never resolving again), so a DNS answer
cannot change between the check and the connection. Every redirect hop goes through the same
checks.

``allow_private`` (the ``broker_allow_private_hosts`` setting) lets loopback and private
addresses through, for tests and for brokers that must reach an internal API. Link-local
(cloud metadata at 169.254.169.254), multicast, unspecified and reserved addresses stay refused
even then: nothing legitimate lives there.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
SCHEMES = ("http", "https")
MAX_URL_CHARS = 4096
_DEFAULT_PORTS = {"http": 80, "https": 443}


class Refused(Exception):
    """A request the broker will not make; ``reason`` is safe to show and to record."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Target:
    """A checked destination: the URL as asked and the one address the broker will dial."""

    url: httpx.URL
    address: IPAddress

    @property
    def dial_url(self) -> httpx.URL:
        """The URL with the checked address as its host (the Host header keeps the name)."""
        return self.url.copy_with(host=str(self.address))


def address_refusal(ip: IPAddress, *, allow_private: bool) -> str | None:
    """Why the broker must not connect to ``ip``, or None if it may."""
    if isinstance(ip, ipaddress.IPv6Address):
        mapped = ip.ipv4_mapped or ip.sixtofour
        if mapped is not None:
            return address_refusal(mapped, allow_private=allow_private)
    if ip.is_unspecified or (isinstance(ip, ipaddress.IPv4Address) and ip in _THIS_NETWORK):
        # Linux routes 0.0.0.0/8 to the local host.
        return "unspecified address"
    if ip.is_link_local:
        return "link-local address (cloud metadata lives here)"
    if ip.is_multicast:
        return "multicast address"
    if ip.is_loopback:
        return None if allow_private else "loopback address"
    if ip.is_private or (isinstance(ip, ipaddress.IPv4Address) and ip in _SHARED):
        # is_private also covers documentation and benchmarking ranges; the checks above took
        # the ones that are never acceptable.
        if ip.is_reserved:
            return "reserved address"
        return None if allow_private else "private address"
    if ip.is_reserved or not ip.is_global:
        return "reserved address"
    return None


_SHARED = ipaddress.IPv4Network("100.64.0.0/10")  # carrier-grade NAT, not global
_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")


def parse_url(raw: object) -> httpx.URL:
    """A URL the broker is willing to consider: http(s), a host, no userinfo, bounded size."""
    if not isinstance(raw, str) or not raw.strip():
        raise Refused("url must be a non-empty string")
    if len(raw) > MAX_URL_CHARS:
        raise Refused(f"url longer than {MAX_URL_CHARS} characters")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in raw):
        raise Refused("url contains whitespace or control characters")
    try:
        url = httpx.URL(raw)
    except (httpx.InvalidURL, ValueError) as exc:
        raise Refused(f"url is not valid: {exc}") from exc
    if url.scheme not in SCHEMES:
        raise Refused(f"scheme {url.scheme or '(none)'!r} is not allowed; use http or https")
    if not url.host:
        raise Refused("url has no host")
    if url.userinfo:
        raise Refused("credentials in the url (user:password@) are not allowed")
    return url


def port_of(url: httpx.URL) -> int:
    return url.port or _DEFAULT_PORTS[url.scheme]


async def resolve(url: httpx.URL, *, allow_private: bool) -> Target:
    """Resolve the URL's host once and check every address it has; Refused if any is bad."""
    host = url.host
    try:
        literal: IPAddress | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        addresses = [literal]
    else:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port_of(url), type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise Refused(f"cannot resolve host {host!r}") from exc
        addresses = []
        for info in infos:
            # Drop an IPv6 zone id ("fe80::1%eth0"); the address class is what matters.
            text = str(info[4][0]).split("%", 1)[0]
            ip = ipaddress.ip_address(text)
            if ip not in addresses:
                addresses.append(ip)
        if not addresses:
            raise Refused(f"cannot resolve host {host!r}")
    for ip in addresses:
        why = address_refusal(ip, allow_private=allow_private)
        if why is not None:
            raise Refused(f"host {host!r} resolves to a {why}")
    return Target(url=url, address=addresses[0])


def public_url(url: httpx.URL | str) -> str:
    """What may be recorded: scheme, host, port and path; never userinfo, query or fragment."""
    try:
        parsed = url if isinstance(url, httpx.URL) else httpx.URL(url)
        shown = parsed.copy_with(userinfo=b"", query=None, fragment=None)
        text = str(shown)
    except (httpx.InvalidURL, ValueError, TypeError):
        return "(invalid url)"
    return text[:1024]
