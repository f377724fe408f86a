"""Redaction of a connection's stored credentials from what an upstream sends back.

An API may echo the request's headers (a debugging endpoint does), and not always byte for
byte: percent-encoded in a URL, escaped in JSON or HTML, hex-encoded, inside base64. Each
secret is matched in every such form:

- **text**: each byte as itself (letters in either case), ``%HH`` (and ``%25HH``, encoded
  twice), ``\\uHHHH``/``\\xHH``, ``&#xHH;``/``&#DD;``, ``+`` for a space and ``\\/`` for a slash,
  mixed freely from byte to byte;
- **hex**: two hex digits per byte, upper or lower case;
- **base64**: the characters that depend on the secret's bytes alone, for each of the three
  alignments inside a longer base64 text, standard and URL-safe alphabets.

:class:`Redactor` is streaming: :meth:`Redactor.feed` holds back the last ``longest match - 1``
bytes, so a secret split across chunks is still found whole; :meth:`Redactor.finish` flushes.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable

REDACTED = b"[redacted]"
# The longest spelling of one byte in the text form: "&#x00HH;" (8) vs "\\u00HH" (6).
_TEXT_BYTE_MAX = 8


def _hex_class(nibble: int) -> bytes:
    h = b"%x" % nibble
    return b"[" + h + h.upper() + b"]" if h.isalpha() else h


def _hex_byte(b: int) -> bytes:
    return _hex_class(b >> 4) + _hex_class(b & 0xF)


def _text_byte(b: int) -> bytes:
    hx = _hex_byte(b)
    alts = [
        b"%" + hx,
        b"%25" + hx,
        rb"\\[uU]00" + hx,
        rb"\\x" + hx,
        b"&#[xX]0{0,2}" + hx + b";",
        b"&#0{0,2}" + str(b).encode() + b";",
    ]
    ch = bytes([b])
    if ch.isalpha():
        alts.insert(0, b"[" + ch.lower() + ch.upper() + b"]")
    else:
        alts.insert(0, re.escape(ch))
    if ch == b" ":
        alts.append(rb"\+")
    if ch == b"/":
        alts.append(rb"\\/")
    return b"(?:" + b"|".join(alts) + b")"


def _base64_cores(secret: bytes) -> list[bytes]:
    """The base64 characters fixed by ``secret`` alone, wherever it sits in a longer text."""
    cores = []
    for align in range(3):
        encoded = base64.b64encode(b"\0" * align + secret + b"\0\0")
        # character i carries bits [6i, 6i + 6); the secret's are [8 align, 8 (align + n))
        first = -(-8 * align // 6)
        last = (8 * (align + len(secret))) // 6  # exclusive
        core = encoded[first:last]
        if len(core) >= 4:
            cores.append(core)
            cores.append(core.translate(bytes.maketrans(b"+/", b"-_")))
    return cores


def _forms(secret: bytes) -> tuple[list[bytes], int]:
    """Regex alternatives for one secret, and the longest match they can make."""
    alts = [b"".join(_text_byte(b) for b in secret), b"".join(_hex_byte(b) for b in secret)]
    alts += [re.escape(core) for core in dict.fromkeys(_base64_cores(secret))]
    return alts, max(_TEXT_BYTE_MAX * len(secret), 2 * len(secret))


class Redactor:
    """Replaces every form of each secret by ``[redacted]`` in a stream of bytes."""

    def __init__(self, secrets: Iterable[str]) -> None:
        self.secrets = tuple(dict.fromkeys(s for s in secrets if s))
        values = sorted({s.encode("utf-8", "replace") for s in self.secrets}, key=len, reverse=True)
        alts: list[bytes] = []
        longest = 0
        for value in values:
            forms, most = _forms(value)
            alts += forms
            longest = max(longest, most)
        # Longer secrets first: a token inside a longer stored value is matched as the value.
        self._pattern = re.compile(b"|".join(alts)) if alts else None
        self.hold = max(0, longest - 1)
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        """The bytes of ``data`` (after what is held) that are safe to pass on now."""
        if self._pattern is None:
            return data
        buf = self._held + data
        # A match starting before `safe` ends inside `buf` (no match is longer than hold + 1);
        # one starting later may still grow with the next chunk, so it waits.
        safe = len(buf) - self.hold
        out = bytearray()
        pos = 0
        for m in self._pattern.finditer(buf):
            if m.start() >= safe:
                break
            out += buf[pos : m.start()]
            out += REDACTED
            pos = m.end()
        cut = max(pos, safe)
        out += buf[pos:cut]
        self._held = buf[cut:]
        return bytes(out)

    def finish(self) -> bytes:
        """Everything still held, redacted; the redactor is empty afterwards."""
        if self._pattern is None:
            rest, self._held = self._held, b""
            return rest
        rest = self._pattern.sub(REDACTED, self._held)
        self._held = b""
        return rest


def redact(data: bytes, secrets: Iterable[str]) -> bytes:
    """``data`` with every form of each secret redacted (one whole buffer)."""
    r = Redactor(secrets)
    return r.feed(data) + r.finish()
