"""A connection flood against a channel listener, from a process of its own (the test's and
the bench's attacker; loopback only).

    python -m tests.hostlink.flood 127.0.0.1:PORT --connections 20000 --sources 40 --waves 2

Each wave opens ``--connections`` connections as fast as it can, without the key, from
127.0.0.1 and ``--sources`` - 1 more loopback addresses (127.0.0.2, …) in turn, and keeps them
open; the next wave closes them as it opens its own. One connection in ``--payload-every``
sends something: a header too deeply nested to parse (all brackets, under the size cap), or
the first bytes of a 64 KiB header that never comes (slow loris); the rest send nothing.
Prints ``wave N opened M`` after each wave, then holds the last until its stdin closes.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import resource
import socket
import struct
import sys
from collections import deque

NESTED = b"[" * 40_000 + b"]" * 20_000  # 60,000 bytes: under the 64 KiB header cap
PAYLOADS = (
    struct.pack(">I", len(NESTED)) + NESTED,
    struct.pack(">I", 65_536) + b'{"v":1,"op":"',  # a slow loris: the rest never comes
)


def room_for(n: int) -> int:
    """Raise this process's descriptor limit toward ``n`` (root may raise the hard one too);
    how many it may hold."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 64
    if hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return n
        except (ValueError, OSError):
            pass
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    return min(n, hard - 64)


def open_one(target: tuple[str, int], source: str, payload: bytes | None) -> socket.socket | None:
    sock = socket.socket()
    try:
        sock.bind((source, 0))
        if payload is None:
            sock.setblocking(False)
            err = sock.connect_ex(target)
            if err not in (0, errno.EINPROGRESS):
                sock.close()
                return None
        else:
            sock.settimeout(2.0)
            sock.connect(target)
            sock.sendall(payload)
            sock.setblocking(False)
    except OSError:
        sock.close()
        return None
    return sock


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("--connections", type=int, default=20_000)
    ap.add_argument("--sources", type=int, default=40)
    ap.add_argument("--waves", type=int, default=1)
    ap.add_argument("--payload-every", type=int, default=50)
    args = ap.parse_args()
    host, _, port = args.address.rpartition(":")
    target = (host, int(port))
    n = room_for(args.connections)
    sources = itertools.cycle(f"127.0.0.{i}" for i in range(1, args.sources + 1))
    held: deque[socket.socket] = deque()
    for wave in range(1, args.waves + 1):
        opened = 0
        for i in range(n):
            if len(held) >= n:
                held.popleft().close()
            payload = PAYLOADS[i // args.payload_every % 2] if i % args.payload_every == 0 else None
            sock = open_one(target, next(sources), payload)
            if sock is not None:
                held.append(sock)
                opened += 1
        print(f"wave {wave} opened {opened}", flush=True)
    sys.stdin.read()
    for sock in held:
        sock.close()


if __name__ == "__main__":
    main()
