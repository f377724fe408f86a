"""What the model gateway adds to a model call: the same client code inside a real sandbox
(namespaces, gvisor), calling ``http://model.internal/v1/chat/completions`` through the egress
proxy, vs run on the host against the same local model server (``ephemeral/testing/providers.py``,
Chat Completions wire format) directly. Measured per call (non-streamed) and per streamed call
(time to first and to last token of a ``--tokens``-token answer the server paces at
``--token-ms``), p50/p99. Beside it, the floor:
a plain HTTP request through the same proxy to the same server (what egress alone costs).
Targets (issue 24): <= 3 ms added per call at p50, <= 1.2x time to last token. Asserts nothing.

    .venv/bin/python bench/gateway.py [--n 200] [--tokens 100] [--levels namespaces,gvisor]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from ephemeral.engine import exits
from ephemeral.engine.runtime import Runtime
from ephemeral.policy import RunRequest
from ephemeral.settings import Settings
from ephemeral.testing.providers import (
    CapturedRequest,
    FakeOpenAIServer,
    FakeReply,
    openai_chat_response,
    openai_chat_stream,
)

MODEL = "openai/gpt-4o-mini"

# Raw sockets, so the client adds the same (small) cost in both places. A call ends when its
# framing says so (Content-Length, the last chunk, or [DONE] for a stream), as SDKs read it:
# not at the connection's close, which comes after the gateway's bookkeeping.
CLIENT = r"""
import json, socket, sys, time
mode, host, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
proxy = ("127.0.0.1", int(sys.argv[5])) if mode != "direct" else None

def request(path, body, plain=False):
    payload = json.dumps(body).encode()
    if mode == "direct":
        s = socket.create_connection((host, port)); target = path
        hosthdr = f"{host}:{port}"
    else:
        s = socket.create_connection(proxy)
        hosthdr = f"{host}:{port}" if plain else "model.internal"
        target = f"http://{hosthdr}{path}"
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(
        f"POST {target} HTTP/1.1\r\nHost: {hosthdr}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer placeholder\r\nContent-Length: {len(payload)}\r\n"
        f"Connection: close\r\n\r\n".encode() + payload
    )
    return s

def whole(s, t0):
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, _, body = buf.partition(b"\r\n\r\n")
    assert b" 200 " in head[:20], buf[:300]
    length = None
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    chunked = b"transfer-encoding: chunked" in head.lower()
    while True:
        if length is not None and len(body) >= length:
            break
        if chunked and body.endswith(b"0\r\n\r\n"):
            break
        b = s.recv(65536)
        if not b:
            break
        body += b
    s.close()
    return (time.perf_counter() - t0) * 1000

def streamed(s, t0):
    buf, first = b"", None
    while True:
        b = s.recv(65536)
        if not b:
            raise SystemExit("stream ended before [DONE]: " + buf[-300:].decode("latin-1"))
        buf += b
        if first is None and b'"content": "t' in buf:
            first = (time.perf_counter() - t0) * 1000
        if b"[DONE]" in buf:
            last = (time.perf_counter() - t0) * 1000
            s.close()
            return first, last

msgs = [{"role": "user", "content": "count to a hundred"}]
ask = {"model": "gpt-4o-mini", "messages": msgs}
out = {"call_ms": [], "first_ms": [], "last_ms": [], "plain_ms": []}
for _ in range(n):
    t0 = time.perf_counter()
    out["call_ms"].append(whole(request("/v1/chat/completions", ask), t0))
for _ in range(n):
    t0 = time.perf_counter()
    body = {**ask, "stream": True}
    first, last = streamed(request("/v1/chat/completions", body), t0)
    out["first_ms"].append(first); out["last_ms"].append(last)
if mode != "direct":
    for _ in range(n):  # the floor: the same POST as plain HTTP through the proxy, no gateway
        t0 = time.perf_counter()
        out["plain_ms"].append(whole(request("/v1/chat/completions", ask, plain=True), t0))
print(json.dumps(out))
"""


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[max(0, min(len(values) - 1, round(p / 100 * (len(values) - 1))))]


def line(label: str, ms: list[float]) -> str:
    return f"{label:<34} p50={pct(ms, 50):7.2f} ms  p99={pct(ms, 99):7.2f} ms"


def report(
    level: str, n: int, tokens: int, token_ms: float, direct: dict[str, Any], gw: dict[str, Any]
) -> None:
    print(f"\n== gateway on {level} (n={n}, {tokens}-token streams, {token_ms:g} ms a token)")
    print(line("call, direct (floor)", direct["call_ms"]))
    print(line("call, plain HTTP via proxy (floor)", gw["plain_ms"]))
    print(line("call via gateway", gw["call_ms"]))
    for p in (50, 99):
        print(
            f"{'':<34} added p{p}: {pct(gw['call_ms'], p) - pct(direct['call_ms'], p):6.2f} ms "
            f"vs direct, {pct(gw['call_ms'], p) - pct(gw['plain_ms'], p):6.2f} ms vs the proxy "
            "alone"
        )
    print(line("first token, direct (floor)", direct["first_ms"]))
    print(line("first token via gateway", gw["first_ms"]))
    print(line("last token, direct (floor)", direct["last_ms"]))
    print(line("last token via gateway", gw["last_ms"]))
    for p in (50, 99):
        d, g = pct(direct["last_ms"], p), pct(gw["last_ms"], p)
        print(
            f"{'':<34} p{p}: {g / d:5.2f}x time to last token, "
            f"{(g - d) / tokens * 1000:7.1f} us added per streamed token"
        )


async def main(levels: list[str], n: int, tokens: int, token_ms: float) -> None:
    from ephemeral.sandbox import registry

    def plain(req: CapturedRequest) -> FakeReply:
        if json.loads(req.body).get("stream"):
            pieces = [f"t{i} " for i in range(tokens)]
            return FakeReply(
                stream=openai_chat_stream(pieces, prompt_tokens=12, completion_tokens=tokens),
                chunk_delay=token_ms / 1000,
            )
        answer = openai_chat_response(content="one two", prompt_tokens=12, completion_tokens=2)
        return FakeReply(body=answer)

    server = FakeOpenAIServer([plain] * (3 * n * (len(levels) + 1) + 10)).start()
    port = int(server.base_url.rsplit(":", 1)[1].split("/")[0])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "client.py"
            script.write_text(CLIENT)
            host = subprocess.run(
                ["python3", str(script), "direct", "127.0.0.1", str(port), str(n)],
                capture_output=True,
                text=True,
                check=True,
            )
            direct = json.loads(host.stdout)
            settings = Settings.load(
                state_dir=Path(tmp) / "state",
                executor="plain",
                openai_base_url=server.base_url,
                broker_allow_private_hosts=True,
            )
            runtime = await Runtime.start(settings)
            try:
                for level in levels:
                    why = await registry.probe_level(level, settings)
                    if why is not None:
                        print(f"\n== gateway on {level}: skipped ({why})")
                        continue
                    request = RunRequest(
                        prompt="bench",
                        model="replay/sandbox-proof",
                        web=True,  # for the floor: plain HTTP through the same proxy
                        shell=True,
                        isolation=level,
                        models=[MODEL],
                        max_cost_micros=10_000_000,
                        timeout_seconds=3600,
                    )
                    row, _ = await runtime.admit(await runtime.local_org(), request)
                    agent = await runtime.engine.build(row.id)
                    task = asyncio.current_task()
                    assert task is not None
                    runtime.engine.state(agent.run_id).task = task  # this bench executes the run
                    await agent.provision()
                    try:
                        assert agent.sandbox is not None
                        await agent.sandbox.put_file("client.py", CLIENT.encode())
                        argv = ["python3", "client.py", "gateway", "127.0.0.1", str(port), str(n)]
                        res = await agent.sandbox.exec(
                            [*argv, str(settings.egress_port)], timeout=1200, max_output=1 << 22
                        )
                        if res.exit_code != 0:
                            failed = agent.egress.failed if agent.egress else None
                            print(f"\n== gateway on {level}: client failed ({failed}): ")
                            print(res.stderr[-800:])
                            continue
                        gw = json.loads(res.stdout)
                    finally:
                        await agent.teardown()
                        agent.exit = agent.exit or exits.succeeded()
                        await agent.settle()
                    report(level, n, tokens, token_ms, direct, gw)
                    charged = await runtime.store.money.charged(row.id)
                    print(f"model charged: {charged['model_micros']} micros for {2 * n} calls")
            finally:
                await runtime.close()
    finally:
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--token-ms", type=float, default=2.0, help="the server's pace")
    parser.add_argument("--levels", default="namespaces,gvisor")
    ns = parser.parse_args()
    asyncio.run(main(ns.levels.split(","), ns.n, ns.tokens, ns.token_ms))
