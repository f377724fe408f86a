"""The redactor alone, by property: a secret in any form it can take (raw in any case,
URL-encoded, JSON- or HTML-escaped, hex, inside base64 at any alignment), anywhere in arbitrary
bytes, cut into arbitrary chunks, never comes out; and cutting never changes the result.

The check of what came out (:func:`leaks`) decodes the output independently of how the
redactor matches: it lower-cases, percent-decodes, unescapes and base64-decodes every run."""

from __future__ import annotations

import base64
import binascii
import contextlib
import html
import re
from urllib.parse import quote, quote_plus, unquote_to_bytes

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ephemeral.broker.redact import REDACTED, Redactor, redact

SECRET_CHARS = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
secrets = st.text(SECRET_CHARS, min_size=8, max_size=48)
noise = st.binary(max_size=200)


def _json_escape(s: bytes) -> bytes:
    return b"".join(b"\\u%04x" % c if i % 2 else bytes([c]) for i, c in enumerate(s))


def _html_escape(s: bytes) -> bytes:
    return b"".join(b"&#x%02X;" % c if i % 3 else b"&#%d;" % c for i, c in enumerate(s))


def _b64_in(prefix: bytes, s: bytes, suffix: bytes, urlsafe: bool) -> bytes:
    blob = prefix + s + suffix
    return base64.urlsafe_b64encode(blob) if urlsafe else base64.b64encode(blob)


FORMS = {
    "raw": lambda s, p, q: s,
    "upper": lambda s, p, q: s.upper(),
    "lower": lambda s, p, q: s.lower(),
    "quote": lambda s, p, q: quote(s, safe="").encode(),
    "quote_lower": lambda s, p, q: re.sub(
        rb"%[0-9A-F]{2}", lambda m: m.group().lower(), quote(s, safe="").encode()
    ),
    "quote_all": lambda s, p, q: "".join(f"%{c:02X}" for c in s).encode(),
    "quote_plus": lambda s, p, q: quote_plus(s, safe="/").encode(),
    "quote_twice": lambda s, p, q: quote(quote(s, safe=""), safe="").encode(),
    "json": lambda s, p, q: _json_escape(s),
    "json_slash": lambda s, p, q: s.replace(b"/", b"\\/"),
    "html": lambda s, p, q: _html_escape(s),
    "hex": lambda s, p, q: s.hex().encode(),
    "HEX": lambda s, p, q: s.hex().upper().encode(),
    "b64": lambda s, p, q: _b64_in(p, s, q, False),
    "b64url": lambda s, p, q: _b64_in(p, s, q, True),
    "b64_bare": lambda s, p, q: base64.b64encode(s).rstrip(b"="),
}


def _unescape(data: bytes) -> bytes:
    text = data.decode("latin-1")
    text = re.sub(r"\\[uU]([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), text)
    text = text.replace("\\/", "/")
    return html.unescape(text).encode("latin-1", "replace")


def _b64_decodings(data: bytes) -> list[bytes]:
    out = []
    for run in re.findall(rb"[A-Za-z0-9+/_-]{8,}", data):
        std = run.replace(b"-", b"+").replace(b"_", b"/")
        for off in range(4):
            piece = std[off:]
            if len(piece) % 4 == 1:
                piece = piece[:-1]
            piece += b"=" * (-len(piece) % 4)
            with contextlib.suppress(binascii.Error, ValueError):
                out.append(base64.b64decode(piece))
    return out


def leaks(out: bytes, secret: bytes) -> bool:
    low = secret.lower()
    views = [out, _unescape(out), unquote_to_bytes(out), unquote_to_bytes(unquote_to_bytes(out))]
    views.append(unquote_to_bytes(out.replace(b"+", b" ")))
    if any(low in v.lower() for v in views):
        return True
    if secret.hex() in out.decode("latin-1").lower():
        return True
    return any(secret in d for d in _b64_decodings(out))


def _streamed(data: bytes, values: list[str], cuts: list[int]) -> bytes:
    r = Redactor(values)
    out = bytearray()
    last = 0
    for cut in sorted({min(c, len(data)) for c in cuts}):
        out += r.feed(data[last:cut])
        last = cut
    out += r.feed(data[last:]) + r.finish()
    return bytes(out)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    secret=secrets,
    form=st.sampled_from(sorted(FORMS)),
    before=noise,
    after=noise,
    b64_prefix=st.binary(max_size=5),
    b64_suffix=st.binary(max_size=5),
    copies=st.integers(1, 3),
    cuts=st.lists(st.integers(0, 2000), max_size=12),
)
def test_no_form_of_the_secret_comes_out_however_it_is_cut(
    secret: str,
    form: str,
    before: bytes,
    after: bytes,
    b64_prefix: bytes,
    b64_suffix: bytes,
    copies: int,
    cuts: list[int],
) -> None:
    raw = secret.encode()
    encoded = FORMS[form](raw, b64_prefix, b64_suffix)
    data = before + (encoded + after) * copies
    assert leaks(data, raw), (form, encoded)  # the check sees the form before redaction
    out = _streamed(data, [secret], cuts)
    assert not leaks(out, raw), (form, encoded, out)
    assert out == redact(data, [secret])  # where the chunks fall changes nothing
    assert REDACTED in out


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=20))
def test_bytes_without_a_secret_pass_unchanged_whatever_the_chunks(
    data: bytes, cuts: list[int]
) -> None:
    secret = "canary-5f3a9c1e7b2d4068-secret"
    if leaks(data, secret.encode()):
        return
    assert _streamed(data, [secret], cuts) == data


@settings(max_examples=100, deadline=None)
@given(token=secrets, cuts=st.lists(st.integers(0, 400), max_size=8))
def test_a_stored_value_and_its_token_are_both_redacted(token: str, cuts: list[int]) -> None:
    value = f"Bearer {token}"
    data = f'{{"authorization": "{value}", "again": "{token}"}}'.encode()
    out = _streamed(data, [value, token], cuts)
    assert not leaks(out, token.encode())
    assert out.count(REDACTED) == 2


def test_the_hold_back_is_the_longest_form_minus_one() -> None:
    r = Redactor(["x" * 10, "y" * 40])
    assert r.hold == 8 * 40 - 1  # "&#x00HH;" per byte is the longest spelling
    assert r.feed(b"a" * 1000) == b"a" * (1000 - r.hold)
    assert r.finish() == b"a" * r.hold
    assert Redactor([]).feed(b"abc") == b"abc"
