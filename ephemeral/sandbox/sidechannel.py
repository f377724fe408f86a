"""Reading a guest's side channels (a runtime's stderr, a microVM's console) at a bounded cost.

These pipes carry diagnostics only, and the guest decides how much goes into them: read as fast
as it writes, a flood cost the host's Python process 41-75 % of a core and slowed every other
sandbox. So each channel is read through a token bucket. Past the budget the reader simply stops
reading: the transport's buffer fills, it pauses, the pipe fills and the writer blocks in its own
``write`` (back-pressure costs the host nothing). Only the last ``keep`` bytes are kept.
"""

from __future__ import annotations

import asyncio
import time

# Per channel: a burst for a runtime's start-up chatter or a boot log, then a trickle.
RATE_BYTES_PER_SECOND = 64 * 1024
BURST_BYTES = 256 * 1024
CHUNK = 16 * 1024


class TokenBucket:
    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self._at = time.monotonic()

    def spend(self, n: int) -> float:
        """Take ``n`` tokens; the seconds to wait before the balance is back to zero."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self._at) * self.rate)
        self._at = now
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


async def drain(
    stream: asyncio.StreamReader,
    buf: bytearray,
    *,
    keep: int,
    rate: float | None = None,
    burst: float | None = None,
) -> None:
    """Read ``stream`` to EOF into ``buf`` (its last ``keep`` bytes), at most ``rate`` bytes/s
    (default: the module's constants, read at call time so a benchmark can lift them)."""
    bucket = TokenBucket(rate or RATE_BYTES_PER_SECOND, burst or BURST_BYTES)
    while chunk := await stream.read(CHUNK):
        buf += chunk
        if len(buf) > keep:
            del buf[: len(buf) - keep]
        wait = bucket.spend(len(chunk))
        if wait > 0:
            await asyncio.sleep(wait)
