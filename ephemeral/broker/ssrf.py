"""Where the broker may send a request: URL shape checks and address classes (SSRF guard).

The broker resolves a host once, refuses it if *any* of its addresses is not a public unicast
address, and then connects to the address it checked (never resolving again), so a DNS answer
cannot change between the check and the connection. Every redirect hop goes through the same
checks.

``allow_private`` (the ``broker_allow_private_hosts`` setting) lets loopback and private
addresses through, for tests and for brokers that must reach an internal API. Link-local
(cloud metadata at 169.254.169.254), multicast, unspecified and reserved addresses stay refused
even then: nothing legitimate lives there.

:class:`PrivateAllow` (the ``egress_allow_private`` setting) is narrower and goes further: the
host names and networks an operator lists (an internal mirror, a proxy) pass whatever class
their addresses are, and nothing else does. The broker applies it to web traffic only (runs
and sessions with ``web`` granted), never to connections.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
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


@dataclass(frozen=True)
class PrivateAllow:
    """Hosts and networks an operator lets past the address rule (``egress_allow_private``).

    A listed host name passes whatever its addresses are (the operator trusts that name's DNS:
    the broker still resolves it once and dials the address it resolved); an address inside a
    listed network passes whatever its class, link-local and the other special-purpose ranges
    included (the operator named it). Entries are normalized by ``Settings``."""

    names: frozenset[str]
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]

    @classmethod
    def of(cls, entries: Iterable[str]) -> PrivateAllow | None:
        names: set[str] = set()
        networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry))
            except ValueError:
                names.add(entry.lower().rstrip("."))
        return cls(frozenset(names), tuple(networks)) if names or networks else None

    def admits(self, host: str, ip: IPAddress) -> bool:
        return host.lower().rstrip(".") in self.names or any(
            ip.version == net.version and ip in net for net in self.networks
        )


def address_refusal(ip: IPAddress, *, allow_private: bool) -> str | None:
    """Why the broker must not connect to ``ip``, or None if it may.

    Classes come from the IANA special-purpose registries (IPv4 and IPv6), written out here
    rather than taken from ``ipaddress``'s ``is_*`` flags, whose tables changed between Python
    patch releases. An IPv6 address that carries an IPv4 one (mapped, NAT64, 6to4) is judged
    by the address it carries; IPv6 outside global unicast (2000::/3) is refused.
    """
    if isinstance(ip, ipaddress.IPv6Address):
        for wrapper, extract in _EMBEDDING:
            if ip in wrapper:
                return address_refusal(extract(ip), allow_private=allow_private)
    table = _V4 if isinstance(ip, ipaddress.IPv4Address) else _V6
    for net, why, private in table:
        if ip in net:
            return None if private and allow_private else why
    if isinstance(ip, ipaddress.IPv6Address) and ip not in _V6_GLOBAL_UNICAST:
        return "reserved address"
    return None


def _net(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(text)


_LINK_LOCAL = "link-local address (cloud metadata lives here)"
# (network, reason, private): a private network is allowed with allow_private; the others
# never are (nothing legitimate lives there). First match wins.
_V4: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str, bool]] = [
    (_net("0.0.0.0/8"), "unspecified address", False),  # Linux routes it to the local host
    (_net("127.0.0.0/8"), "loopback address", True),
    (_net("10.0.0.0/8"), "private address", True),
    (_net("100.64.0.0/10"), "private address", True),  # carrier-grade NAT
    (_net("172.16.0.0/12"), "private address", True),
    (_net("192.168.0.0/16"), "private address", True),
    (_net("169.254.0.0/16"), _LINK_LOCAL, False),
    (_net("192.0.0.0/24"), "reserved address", False),  # IETF protocol assignments
    (_net("192.0.2.0/24"), "reserved address", False),  # documentation
    (_net("192.88.99.0/24"), "reserved address", False),  # 6to4 relay anycast (deprecated)
    (_net("198.18.0.0/15"), "reserved address", False),  # benchmarking
    (_net("198.51.100.0/24"), "reserved address", False),  # documentation
    (_net("203.0.113.0/24"), "reserved address", False),  # documentation
    (_net("224.0.0.0/4"), "multicast address", False),
    (_net("240.0.0.0/4"), "reserved address", False),  # future use, and the broadcast address
]
_V6: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str, bool]] = [
    (_net("::/128"), "unspecified address", False),
    (_net("::1/128"), "loopback address", True),
    (_net("::/96"), "reserved address", False),  # IPv4-compatible (deprecated)
    (_net("::ffff:0:0:0/96"), "reserved address", False),  # IPv4-translated (SIIT)
    (_net("64:ff9b:1::/48"), "private address", True),  # local-use NAT64
    (_net("100::/64"), "reserved address", False),  # discard-only
    (_net("2001::/23"), "reserved address", False),  # IETF protocol assignments, Teredo incl.
    (_net("2001:db8::/32"), "reserved address", False),  # documentation
    (_net("3fff::/20"), "reserved address", False),  # documentation
    (_net("5f00::/16"), "reserved address", False),  # SRv6 SIDs
    (_net("fc00::/7"), "private address", True),  # unique local
    (_net("fe80::/10"), _LINK_LOCAL, False),
    (_net("fec0::/10"), "site-local address (deprecated)", False),
    (_net("ff00::/8"), "multicast address", False),
]
_V6_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")


def _mapped(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)


def _sixtofour(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address((int(ip) >> 80) & 0xFFFFFFFF)


_EMBEDDING: list[tuple[ipaddress.IPv6Network, Callable[[ipaddress.IPv6Address], IPAddress]]] = [
    (ipaddress.IPv6Network("::ffff:0:0/96"), _mapped),  # IPv4-mapped
    (ipaddress.IPv6Network("64:ff9b::/96"), _mapped),  # NAT64, well-known prefix
    (ipaddress.IPv6Network("2002::/16"), _sixtofour),  # 6to4
]


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
        raise Refused(f"url is not valid: {str(exc)!r}") from exc
    if url.scheme not in SCHEMES:
        raise Refused(f"scheme {url.scheme or '(none)'!r} is not allowed; use http or https")
    if not url.host:
        raise Refused("url has no host")
    if url.userinfo:
        raise Refused("credentials in the url (user:password@) are not allowed")
    return url


def port_of(url: httpx.URL) -> int:
    return url.port or _DEFAULT_PORTS[url.scheme]


async def resolve(
    url: httpx.URL, *, allow_private: bool, allowed: PrivateAllow | None = None
) -> Target:
    """Resolve the URL's host once and check every address it has; Refused if any is bad
    (an address ``allowed`` admits for this host is not checked further)."""
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
        if allowed is not None and allowed.admits(host, ip):
            continue
        why = address_refusal(ip, allow_private=allow_private)
        if why is not None:
            raise Refused(f"host {host!r} resolves to a {why}")
    return Target(url=url, address=addresses[0])


async def resolve_within(
    url: httpx.URL,
    seconds: float,
    *,
    allow_private: bool,
    allowed: PrivateAllow | None = None,
    timeout_reason: str = "timed out resolving the host",
) -> Target:
    """:func:`resolve` under a time limit: a resolver that does not answer within ``seconds`` is
    a refusal too (``Refused(timeout_reason)``), so every caller turns both into one 403."""
    try:
        async with asyncio.timeout(seconds):
            return await resolve(url, allow_private=allow_private, allowed=allowed)
    except TimeoutError:
        raise Refused(timeout_reason) from None


def public_url(url: httpx.URL | str) -> str:
    """What may be recorded: scheme, host, port and path; never userinfo, query or fragment."""
    try:
        parsed = url if isinstance(url, httpx.URL) else httpx.URL(url)
        shown = parsed.copy_with(userinfo=b"", query=None, fragment=None)
        text = str(shown)
    except (httpx.InvalidURL, ValueError, TypeError):
        return "(invalid url)"
    return text[:1024]


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


def event_reason(reason: str, *, zdr: bool) -> str:
    """A refusal's reason as its ``*.denied`` event keeps it. Every reason quotes what came
    from the request, the network or the store (host, path, URL, name: ``!r``); under zero
    data retention each quoted part becomes ``'…'``, so the reason keeps its kind only."""
    return _QUOTED.sub("'…'", reason) if zdr else reason
