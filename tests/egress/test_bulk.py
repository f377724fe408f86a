"""Bulk bytes over the guest channel once egress is on: a request frame larger than the
guest's read buffer (a big file) and many MiB through a tunnel both ways arrive whole, and
every MiB is charged once, in the ledger and on the tunnel's event."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from ephemeral.engine.runtime import Runtime
from tests.egress.conftest import Names, provisioned, sh

DOWN = 9 << 20  # upstream -> sandbox
UP = 5 << 20  # sandbox -> upstream

# In the sandbox: a tunnel through the proxy; send UP bytes, shut the sending half, then read
# until the upstream closes. Prints what it read: its length and SHA-256.
CLIENT = """
import hashlib, socket, sys
up = int(sys.argv[2])
s = socket.create_connection(("127.0.0.1", 3128))
s.sendall(f"CONNECT bulk.test:{sys.argv[1]} HTTP/1.1\\r\\nHost: bulk.test\\r\\n\\r\\n".encode())
head = b""
while b"\\r\\n\\r\\n" not in head:
    more = s.recv(1024)
    assert more, head
    head += more
assert b" 200 " in head.split(b"\\r\\n")[0], head
rest = head.split(b"\\r\\n\\r\\n", 1)[1]
s.sendall((bytes(range(256)) * (up // 256 + 1))[:up])
s.shutdown(socket.SHUT_WR)
got = hashlib.sha256(rest)
n = len(rest)
while True:
    b = s.recv(1 << 16)
    if not b:
        break
    got.update(b)
    n += len(b)
print(n, got.hexdigest())
"""


class Bulk:
    """An upstream that reads until the client's half-close, then sends DOWN bytes."""

    def __init__(self) -> None:
        self.payload = os.urandom(DOWN)
        self.received: list[tuple[int, str]] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                digest, n = hashlib.sha256(), 0
                while data := conn.recv(1 << 16):
                    digest.update(data)
                    n += len(data)
                self.received.append((n, digest.hexdigest()))
                conn.sendall(self.payload)


@pytest.fixture
def bulk() -> Iterator[Bulk]:
    server = Bulk()
    yield server
    server.server.close()


async def test_bulk_bytes_arrive_whole_and_each_mib_is_charged_once(
    runtime: Runtime, names: Names, bulk: Bulk, isolation: str
) -> None:
    names.set("bulk.test", "127.0.0.1")
    big = os.urandom(3 << 20)  # one put_file frame, three times the guest's read buffer
    async with provisioned(runtime, isolation, web=True) as agent:
        assert agent.sandbox is not None and agent.egress is not None
        await agent.sandbox.put_file("/tmp/big.bin", big)
        await agent.sandbox.put_file("/tmp/client.py", CLIENT.encode())
        res = await sh(agent, "sha256sum /tmp/big.bin", timeout=60)
        assert res.stdout.split()[0] == hashlib.sha256(big).hexdigest(), res.stderr
        res = await sh(agent, f"python3 /tmp/client.py {bulk.port} {UP}", timeout=120)
        assert res.exit_code == 0, res.stderr
        assert res.stdout.split() == [str(DOWN), hashlib.sha256(bulk.payload).hexdigest()]
        sent = (bytes(range(256)) * (UP // 256 + 1))[:UP]
        assert bulk.received == [(UP, hashlib.sha256(sent).hexdigest())]
        # the buffer grew for the big frame and the channel still takes small ones after it
        await agent.sandbox.put_file("/tmp/small.txt", b"after")
        res = await sh(agent, "cat /tmp/small.txt")
        assert res.stdout == "after"
    events = [e for e in await runtime.store.events.list(agent.run_id) if e.type == "web.requested"]
    assert len(events) == 1
    tunnel = events[0].data
    assert tunnel["status"] == 200 and tunnel["bytes_in"] >= DOWN and tunnel["bytes_out"] >= UP
    moved = tunnel["bytes_in"] + tunnel["bytes_out"]
    mibs = -(-moved // (1 << 20))  # each MiB paid before it moved, the first with the request
    assert tunnel["cost_micros"] == 1000 + 100 * mibs
    row = await runtime.store.runs.get(agent.run_id)
    assert row.breakdown["web_micros"] == tunnel["cost_micros"]
