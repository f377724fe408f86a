"""``web: {"allow": [...]}``: what a pattern may be, what it matches, and where it is shown."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ephemeral.api.view import permission_rows, request_json
from ephemeral.events import Event
from ephemeral.policy import Policy, RunRequest, WebAllow
from ephemeral.timeline import describe


def test_patterns_are_anchored_case_insensitive_and_subdomain_only() -> None:
    allow = WebAllow(allow=["Example.org", "*.files.example.net"])
    assert allow.allow == ["example.org", "*.files.example.net"]
    for host in ("example.org", "EXAMPLE.ORG", "example.org.", "a.files.example.net"):
        assert allow.allows(host), host
    for host in (
        "www.example.org",  # no implicit subdomains
        "evilexample.org",
        "example.org.evil.net",
        "files.example.net",  # `*.` is subdomains only, never the domain itself
        "afiles.example.net",
        "127.0.0.1",
        "",
    ):
        assert not allow.allows(host), host


@pytest.mark.parametrize(
    "pattern", ["*", "*.org", "a.*.org", "exa*mple.org", "1.2.3.4", "http://x.org", "x.org/a", ""]
)
def test_a_bad_pattern_is_refused_naming_the_field(pattern: str) -> None:
    with pytest.raises(ValidationError) as info:
        RunRequest.model_validate({"prompt": "x", "web": {"allow": [pattern]}})
    [error] = info.value.errors()
    assert error["loc"] == ("web",)
    assert error["msg"].startswith('must be true, false or {"allow": [host patterns]}; allow')


@pytest.mark.parametrize(
    "pattern",
    [
        "0x7f.0.0.1",  # hex-dotted (issue 18)
        "0X7F.0.0.1",
        "0x7f000001",
        "0x7f.1",
        "0177.0.0.1",  # octal
        "0177.1",
        "2130706433",  # one decimal integer
        "127.1",
        "a.0x10",  # a last label that is a number makes any name an IPv4 literal
        "*.0x7f.0.0.1",
        "*.10.0.0.1",
        "::1",
        "[::1]",
        "[::ffff:127.0.0.1]",
        "::ffff:7f00:1",
        "fe80::1%eth0",
        "0:0:0:0:0:0:0:1",
    ],
)
def test_an_ip_literal_in_any_spelling_is_refused_naming_the_field(pattern: str) -> None:
    with pytest.raises(ValidationError) as info:
        RunRequest.model_validate({"prompt": "x", "web": {"allow": [pattern]}})
    [error] = info.value.errors()
    assert error["loc"] == ("web",)
    assert "is an IP address; the allow list takes host names" in error["msg"]


def test_names_that_only_look_numeric_stay_allowed() -> None:
    allow = WebAllow(allow=["0x7f.example", "1password.example", "*.123.example", "a1.b2"])
    assert allow.allows("0x7f.example") and allow.allows("x.123.example")


def test_web_shapes() -> None:
    assert Policy().web_on is False and Policy(web=True).web_allow is None
    p = Policy.model_validate({"web": {"allow": ["pypi.example"]}})
    assert p.web_on and p.web_allow == ["pypi.example"]
    assert p.web_shown() == {"allow": ["pypi.example"]}
    assert Policy.model_validate_json(p.model_dump_json()) == p
    with pytest.raises(ValidationError):
        Policy.model_validate({"web": {"allow": ["a.org"], "deny": ["b.org"]}})
    with pytest.raises(ValidationError):
        Policy.model_validate({"web": "yes"})


def test_the_pages_show_the_allow_list() -> None:
    policy = Policy.model_validate({"web": {"allow": ["pypi.example", "*.files.example"]}})
    rows = dict(permission_rows(policy.model_dump(), 30))
    assert rows["Web"] == "on, only to pypi.example, *.files.example"
    assert dict(permission_rows(Policy(web=True).model_dump(), 30))["Web"] == "on"
    assert dict(permission_rows(Policy().model_dump(), 30))["Web"] == "off"
    assert request_json("x", policy.model_dump())["web"] == {
        "allow": ["pypi.example", "*.files.example"]
    }
    event = Event(
        seq=1,
        run_id="run_x",
        type="worker.started",
        at="2026-12-01T00:00:00Z",
        data={"shell": True, "web": {"allow": ["pypi.example"]}, "connections": [], "files": []},
    )
    assert "web on (only pypi.example)" in describe(event)[1]


def test_zero_data_retention_keeps_only_sizes_of_proxy_events() -> None:
    from ephemeral.events import redact_for_zdr

    event = {
        "method": "GET",
        "host": "site.test",
        "port": 80,
        "path": "/a/b",
        "status": 200,
        "bytes_in": 10,
        "bytes_out": 5,
        "cost_micros": 1100,
    }
    assert redact_for_zdr(event) == {
        "method": "GET",
        "host_bytes": 9,
        "port": 80,
        "path_bytes": 4,
        "status": 200,
        "bytes_in": 10,
        "bytes_out": 5,
        "cost_micros": 1100,
    }
