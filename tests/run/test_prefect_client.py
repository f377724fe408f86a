"""The flow executor's transport to the embedded Prefect server: a 503 is sent again at once."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from ephemeral.flows.prefect_client import RetryWhenBusy, retry_when_busy


class Busy:
    """A loopback HTTP server that answers 503 to the first ``busy`` requests, then 201."""

    def __init__(self, busy: int) -> None:
        self.busy = busy
        self.bodies: list[bytes] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                owner.bodies.append(body)
                status = 503 if len(owner.bodies) <= owner.busy else 201
                payload = json.dumps({"n": len(owner.bodies)}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def busy() -> Iterator[Busy]:
    server = Busy(busy=3)
    yield server
    server.close()


async def test_a_503_is_sent_again_with_its_body_until_the_server_takes_it(busy: Busy) -> None:
    transport = RetryWhenBusy(httpx.AsyncHTTPTransport())
    async with httpx.AsyncClient(transport=transport, base_url=busy.url) as client:
        response = await client.post("/api/flow_runs/", json={"name": "run_1"})
    assert response.status_code == 201
    assert response.json() == {"n": 4}
    assert busy.bodies == [b'{"name":"run_1"}'] * 4
    assert transport.retried == 3


async def test_past_its_budget_the_503_goes_back_to_the_caller(busy: Busy) -> None:
    busy.busy = 1000
    transport = RetryWhenBusy(httpx.AsyncHTTPTransport(), first_delay=0.01, budget=0.2)
    async with httpx.AsyncClient(transport=transport, base_url=busy.url) as client:
        response = await client.post("/api/flow_runs/", json={})
    assert response.status_code == 503
    # 10, 20, 40, 80 ms (x 1-1.5 jitter) fit in 0.2 s; the back-off doubles, so never many
    assert 2 <= len(busy.bodies) <= 6
    assert transport.retried == len(busy.bodies) - 1


async def test_a_prefect_client_keeps_its_own_transport_inside() -> None:
    from prefect.client.orchestration import PrefectClient

    client = PrefectClient("http://127.0.0.1:9/api")
    inner = client._client._transport
    wrapped = retry_when_busy(client)
    assert client._client._transport is wrapped
    assert wrapped._inner is inner
