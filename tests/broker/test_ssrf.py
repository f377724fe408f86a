"""The SSRF guard: URL shapes and address classes, checked without sending anything."""

from __future__ import annotations

import asyncio
import ipaddress

import httpx
import pytest

from ephemeral.broker.ssrf import (
    PrivateAllow,
    Refused,
    address_refusal,
    parse_url,
    public_url,
    resolve,
    resolve_within,
)
from ephemeral.settings import Settings

REFUSED_ALWAYS = [
    "0.0.0.0",
    "0.1.2.3",
    "169.254.169.254",  # cloud metadata
    "169.254.0.1",
    "fe80::1",
    "224.0.0.1",
    "ff02::1",
    "240.0.0.1",
    "255.255.255.255",
    "::",
    "::ffff:169.254.169.254",
    # the rest of the IANA special-purpose registries (issue 18)
    "192.0.0.8",  # IETF protocol assignments
    "192.0.2.1",  # documentation
    "192.88.99.1",  # 6to4 relay anycast
    "198.18.0.1",  # benchmarking
    "198.19.255.255",
    "198.51.100.7",
    "203.0.113.9",
    "241.2.3.4",
    "::127.0.0.1",  # IPv4-compatible (deprecated)
    "::ffff:0:7f00:1",  # IPv4-translated
    "100::1",  # discard-only
    "2001:db8::1",  # documentation
    "2001:2::1",  # benchmarking
    "2001:20::1",  # ORCHIDv2
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
    "2001:0:7f00:1:0:0:80ff:fffe",  # Teredo naming 127.0.0.1
    "3fff::1",  # documentation
    "5f00::1",  # SRv6
    "fec0::1",  # site-local (deprecated)
    "fed0::1",
    "feff::1",
    "fe90::1",
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
    "2002:a9fe:a9fe::",  # 6to4 of 169.254.169.254
    "4000::1",  # outside global unicast
    "::ffff:192.0.2.1",
]
REFUSED_UNLESS_ALLOWED = [
    "127.0.0.1",
    "127.8.9.10",
    "::1",
    "10.0.0.1",
    "172.16.5.4",
    "192.168.1.1",
    "100.64.0.1",
    "fc00::1",
    "::ffff:127.0.0.1",
    "::ffff:10.1.2.3",
    "2002:7f00:1::",  # 6to4 wrapping 127.0.0.1
    "100.127.255.254",
    "fd12:3456::1",
    "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
    "64:ff9b:1::1",  # local-use NAT64
    "2002:c0a8:101::1",  # 6to4 of 192.168.1.1
]
PUBLIC = [
    "93.184.216.34",
    "1.1.1.1",
    "2606:4700::1111",
    "64:ff9b::101:101",  # NAT64 of 1.1.1.1
    "2002:101:101::1",  # 6to4 of 1.1.1.1
    "::ffff:1.1.1.1",
    "100.128.0.1",  # just past carrier-grade NAT
    "198.20.0.1",  # just past benchmarking
]


@pytest.mark.parametrize("ip", REFUSED_ALWAYS)
def test_never_allowed_addresses(ip: str) -> None:
    addr = ipaddress.ip_address(ip)
    assert address_refusal(addr, allow_private=False) is not None
    assert address_refusal(addr, allow_private=True) is not None


@pytest.mark.parametrize("ip", REFUSED_UNLESS_ALLOWED)
def test_loopback_and_private_need_the_setting(ip: str) -> None:
    addr = ipaddress.ip_address(ip)
    assert address_refusal(addr, allow_private=False) is not None
    assert address_refusal(addr, allow_private=True) is None


@pytest.mark.parametrize("ip", PUBLIC)
def test_public_addresses_pass(ip: str) -> None:
    assert address_refusal(ipaddress.ip_address(ip), allow_private=False) is None


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("file:///etc/passwd", "scheme"),
        ("ftp://example.com/x", "scheme"),
        ("gopher://127.0.0.1:70/", "scheme"),
        ("javascript:alert(1)", "scheme"),
        ("http://user:pw@example.com/", "credentials"),
        ("http://token@example.com/", "credentials"),
        ("http:///nohost", "host"),
        ("http://exa mple.com/", "whitespace"),
        ("http://example.com/\r\nX: y", "control"),
        ("", "non-empty"),
        ("http://example.com/" + "a" * 5000, "longer"),
    ],
)
def test_bad_urls_are_refused(url: str, why: str) -> None:
    with pytest.raises(Refused) as info:
        parse_url(url)
    assert why in info.value.reason


def test_non_string_url() -> None:
    with pytest.raises(Refused):
        parse_url(["http://example.com"])


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/",
        "http://localhost:8080/",
        "http://2130706433/",  # 127.0.0.1 as one decimal number
        "http://0x7f.1/",
        "http://[::1]/",
        "http://[::ffff:127.0.0.1]/",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/",
    ],
)
async def test_resolution_refuses_local_targets(url: str) -> None:
    with pytest.raises(Refused) as info:
        await resolve(parse_url(url), allow_private=False)
    assert "resolves to" in info.value.reason


async def test_resolution_keeps_the_checked_address() -> None:
    target = await resolve(parse_url("http://localhost:9/x?y=1"), allow_private=True)
    assert target.address.is_loopback
    assert target.dial_url.host == str(target.address)
    assert target.url.host == "localhost"  # the Host header and TLS name stay the name


async def test_a_resolver_that_does_not_answer_in_time_is_a_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """resolve_within: a timeout is a Refused with the caller's reason (the web egress, the
    connection calls and the build proxy each turn it into their 403), a refusal stays one, and
    an answer in time is the checked target."""
    loop = asyncio.get_running_loop()
    answered = loop.getaddrinfo

    async def never_answers(*args: object, **kwargs: object) -> object:
        await asyncio.Event().wait()  # a resolver that hangs: no DNS server is reachable here

    monkeypatch.setattr(loop, "getaddrinfo", never_answers)
    with pytest.raises(Refused) as info:
        await resolve_within(parse_url("http://localhost:9/"), 0.05, allow_private=True)
    assert info.value.reason == "timed out resolving the host"
    with pytest.raises(Refused) as info:
        await resolve_within(
            parse_url("http://localhost:9/"),
            0.05,
            allow_private=True,
            timeout_reason="timed out resolving 'localhost'",
        )
    assert info.value.reason == "timed out resolving 'localhost'"
    monkeypatch.setattr(loop, "getaddrinfo", answered)
    with pytest.raises(Refused, match="resolves to a loopback address"):
        await resolve_within(parse_url("http://localhost:9/"), 5, allow_private=False)
    target = await resolve_within(parse_url("http://localhost:9/"), 5, allow_private=True)
    assert target.address.is_loopback


def _operator_allows(*entries: str) -> PrivateAllow:
    settings = Settings.load(egress_allow_private=list(entries))
    allowed = PrivateAllow.of(settings.egress_allow_private)
    assert allowed is not None
    return allowed


@pytest.mark.parametrize("ip", [*REFUSED_ALWAYS, *REFUSED_UNLESS_ALLOWED])
async def test_an_operator_listed_network_passes_any_address_class(ip: str) -> None:
    """egress_allow_private: every special-purpose range an operator lists passes (issue 36,
    item 6), decided from the literal alone (nothing is sent)."""
    url = parse_url(f"http://[{ip}]/" if ":" in ip else f"http://{ip}/")
    net = f"{ip}/{128 if ':' in ip else 32}"
    target = await resolve(url, allow_private=False, allowed=_operator_allows(net))
    assert target.address == ipaddress.ip_address(ip)
    with pytest.raises(Refused):  # listing another network lets nothing else through
        await resolve(url, allow_private=False, allowed=_operator_allows("192.168.77.0/24"))


async def test_an_operator_listed_name_passes_what_it_resolves_to_and_only_it() -> None:
    allowed = _operator_allows("LocalHost.", "10.0.0.0/8")
    target = await resolve(parse_url("http://localhost:9/"), allow_private=False, allowed=allowed)
    assert target.address.is_loopback
    for url in ("http://127.0.0.1/", "http://[::1]/", "http://172.16.0.1/"):
        with pytest.raises(Refused, match=r"resolves to a (loopback|private) address"):
            await resolve(parse_url(url), allow_private=False, allowed=allowed)
    assert await resolve(parse_url("http://10.9.8.7/"), allow_private=False, allowed=allowed)
    # an IPv4 network does not admit the IPv6 forms that carry its addresses
    with pytest.raises(Refused):
        await resolve(parse_url("http://[::ffff:10.9.8.7]/"), allow_private=False, allowed=allowed)


@pytest.mark.parametrize(
    "entry", ["10.0.0.1/8", "0x7f.1", "10.1", "2130706433", "a b", "fd00::1/8", "-x.internal"]
)
def test_the_operator_list_refuses_what_is_neither_a_name_nor_a_network(entry: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="egress_allow_private"):
        Settings.load(egress_allow_private=[entry])
    assert PrivateAllow.of([]) is None


def test_public_url_strips_query_fragment_and_userinfo() -> None:
    shown = public_url("https://user:pw@example.com:8443/a/b?token=SECRET#frag")
    assert shown == "https://example.com:8443/a/b"
    assert public_url(httpx.URL("http://h/p?q=1")) == "http://h/p"
    assert public_url("http://[::1/") == "(invalid url)"
