"""What the broker adds to one outbound request: a ``web_fetch`` / ``connection_call`` through a
built run (checks, resolve, charge in SQLite, event append) vs a bare httpx GET to the same
local server; then the egress proxy from inside a real sandbox (namespaces, gvisor) vs the
same client code run directly on the host: HTTP round trip, CONNECT tunnel setup, and MiB/s
through a tunnel, beside the same client against servers on the sandbox's own loopback (what
the guest's network stack costs without the proxy). Prints percentiles and ratios; asserts
nothing.

    .venv/bin/python bench/broker.py [--n 200] [--egress-n 200] [--mib 64] [--trials 5]
        [--levels ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx

from bench.served import script_server
from ephemeral.broker import Sealer
from ephemeral.engine import exits
from ephemeral.engine.runtime import Runtime
from ephemeral.policy import RunRequest
from ephemeral.providers.base import ToolCall
from ephemeral.settings import Settings
from tests.broker.conftest import Upstream, _handler


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[max(0, min(len(values) - 1, round(p / 100 * (len(values) - 1))))]


def show(label: str, ms: list[float]) -> None:
    print(
        f"{label:<22} n={len(ms):<4} p50={pct(ms, 50):7.2f} ms  p95={pct(ms, 95):7.2f} ms  "
        f"max={max(ms):7.2f} ms"
    )


async def main(n: int) -> None:
    up = Upstream()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(up))
    up.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings.load(
            state_dir=Path(tmp) / "state", use_prefect=False, broker_allow_private_hosts=True
        )
        runtime = await Runtime.start(settings)
        try:
            org = await runtime.local_org()
            await runtime.store.connections.add(
                org,
                "svc",
                base_url=f"{up.base}/api",
                header_names=["Authorization"],
                sealed_headers=Sealer.for_settings(settings).seal({"Authorization": "Bearer x"}),
            )
            request = RunRequest(
                prompt="bench",
                model="replay/sandbox-proof",
                web=True,
                shell=False,
                isolation="namespaces",
                max_cost_micros=100_000_000,
                connections=[{"name": "svc", "methods": ["GET"], "paths": ["/*"]}],
            )
            row, _ = await runtime.admit(org, request)
            agent = await runtime.engine.build(row.id)

            bare: list[float] = []
            # A new connection per request, as the broker makes (keep-alive to http.server
            # hits the 40 ms delayed-ACK stall and would flatter the broker).
            async with httpx.AsyncClient(trust_env=False) as client:
                for _ in range(n):
                    t = time.perf_counter()
                    await client.get(f"{up.base}/text", headers={"Connection": "close"})
                    bare.append((time.perf_counter() - t) * 1000)
            results: dict[str, list[float]] = {"web_fetch": [], "connection_call": []}
            args = {
                "web_fetch": {"url": f"{up.base}/text?q=1"},
                "connection_call": {"name": "svc", "method": "GET", "path": "/echo"},
            }
            for i in range(n):
                for tool, times in results.items():
                    t = time.perf_counter()
                    await agent.tool_step(ToolCall(id=f"c{i}", name=tool, arguments=args[tool]))
                    times.append((time.perf_counter() - t) * 1000)
            show("bare httpx GET", bare)
            for tool, times in results.items():
                show(tool, times)
            charged = await runtime.store.money.charged(row.id)
            print(f"web charged: {charged['web_micros']} micros for {n} requests")
        finally:
            await runtime.close()
            server.shutdown()


# The same client code runs inside the sandbox (through the proxy) and on the host (direct).
CLIENT = r"""
import json, socket, sys, time
mode, host = sys.argv[1], sys.argv[2]
port, blob_port, n, mib = (int(a) for a in sys.argv[3:7])
PROXY = ("127.0.0.1", int(sys.argv[7])) if len(sys.argv) > 7 else None

def dial(target_port):
    if mode == "proxy":
        s = socket.create_connection(PROXY)
    else:
        s = socket.create_connection((host, target_port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s

def read_all(s):
    out = bytearray()
    while True:
        b = s.recv(1 << 16)
        if not b:
            return bytes(out)
        out += b

def http_once():
    s = dial(port)
    target = f"http://{host}:{port}/text" if mode == "proxy" else "/text"
    s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
    body = read_all(s)
    s.close()
    assert b" 200 " in body[:20], body[:80]

def connect_once(target_port):
    t = time.perf_counter()
    s = dial(target_port)
    if mode == "proxy":
        name = f"{host}:{target_port}"
        s.sendall(f"CONNECT {name} HTTP/1.1\r\nHost: {name}\r\n\r\n".encode())
        got = b""
        while b"\r\n\r\n" not in got:
            more = s.recv(1024)
            assert more, f"the proxy closed the tunnel before answering: {got!r}"
            got += more
        assert b" 200 " in got[:20], got
    return s, (time.perf_counter() - t) * 1000

if len(sys.argv) > 8 and sys.argv[8] == "blob":  # one more tunnel's MiB/s, alone
    s, _ = connect_once(blob_port)
    t = time.perf_counter()
    got = len(read_all(s))
    print(json.dumps({"bytes": got, "seconds": time.perf_counter() - t}))
    sys.exit(0)
http_ms = []
for _ in range(n):
    t = time.perf_counter()
    http_once()
    http_ms.append((time.perf_counter() - t) * 1000)
connect_ms = []
for _ in range(n):
    s, ms = connect_once(port)
    connect_ms.append(ms)
    s.close()
s, _ = connect_once(blob_port)
t = time.perf_counter()
got = len(read_all(s))
seconds = time.perf_counter() - t
print(json.dumps({"http_ms": http_ms, "connect_ms": connect_ms, "bytes": got, "seconds": seconds}))
"""


# The sandbox's own floor: the same client, inside the sandbox, against servers on the
# sandbox's loopback (no proxy, no host). What a request costs in the guest's network stack
# (gVisor's netstack, every socket call a trip through the Sentry) is in it; the proxy is not.
GUEST_LOOPBACK = r"""
import socketserver, subprocess, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Text(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = b"hello from upstream"  # the host's upstream answers /text with these bytes
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass

class Blob(socketserver.BaseRequestHandler):
    def handle(self):
        chunk, left = b"\0" * (1 << 16), int(sys.argv[2]) << 20
        while left > 0:
            self.request.sendall(chunk)
            left -= len(chunk)

text = ThreadingHTTPServer(("127.0.0.1", 0), Text)
blob = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Blob)
for server in (text, blob):
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
ports = [str(text.server_address[1]), str(blob.server_address[1])]
argv = [sys.executable, "client.py", "direct", "127.0.0.1", *ports, sys.argv[1], sys.argv[2]]
sys.stdout.write(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
"""


# The blob upstream runs in its own process, as a real upstream does: in the bench's process
# its threads would hold the GIL the proxy's loop needs, a cost no deployment has.
BLOB = r"""
import socketserver, sys
class Blob(socketserver.BaseRequestHandler):
    def handle(self):
        chunk, left = b"\0" * (1 << 16), int(sys.argv[1]) << 20
        try:
            while left > 0:
                self.request.sendall(chunk)
                left -= len(chunk)
        except OSError:
            pass
server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Blob)
server.daemon_threads = True
print(server.server_address[1], flush=True)
server.serve_forever()
"""


# The relay's floor: what the proxy's path costs without the proxy. Per connection, one process
# copies the upstream's bytes into a pipe and another copies them from the pipe to the client:
# the two extra processes and the four extra copies a stream makes on its way to the sandbox
# (host socket -> guest channel -> guest socket), with no framing, metering or event loop.
RELAY = r"""
import os, socket, sys
upstream = int(sys.argv[1])
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(16)
print(listener.getsockname()[1], flush=True)
while True:
    conn, _ = listener.accept()
    r, w = os.pipe()
    try:
        import fcntl
        fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ, as the guest agent sets its channel
    except OSError:
        pass
    if os.fork() == 0:
        os.close(r)
        up = socket.create_connection(("127.0.0.1", upstream))
        while data := up.recv(128 << 10):
            os.write(w, data)
        os._exit(0)
    if os.fork() == 0:
        os.close(w)
        while data := os.read(r, 128 << 10):
            conn.sendall(data)
        conn.close()
        os._exit(0)
    os.close(r)
    os.close(w)
    conn.close()
    os.wait()
    os.wait()
"""


def _cpu_now(upstream: int) -> dict[str, float]:
    """CPU seconds so far: this process (the proxy), and every process under it but the
    upstream and the benchmark's client (the sandbox: its agent and runtime)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        if b"client.py" in cmd:
            continue
        stats[int(entry.name)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    todo, sandbox = [p for p in children.get(os.getpid(), []) if p != upstream], 0.0
    while todo:
        pid = todo.pop()
        sandbox += (int(stats[pid][11]) + int(stats[pid][12])) / tick
        todo += children.get(pid, [])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"host": usage.ru_utime + usage.ru_stime, "sandbox": sandbox}


def _rate(result: dict[str, float]) -> float:
    return result["bytes"] / (1 << 20) / result["seconds"]


async def _host_blob(script: Path, args: list[str], port: int | None = None) -> dict[str, float]:
    if port is not None:  # the same client, from another port (the relay's)
        args = [*args[:2], str(port), *args[3:]]
    proc = await asyncio.create_subprocess_exec(
        "python3", str(script), "direct", *args, "0", "blob", stdout=subprocess.PIPE
    )
    out, _ = await proc.communicate()
    return json.loads(out)


def show_pair(label: str, direct: list[float], proxied: list[float]) -> None:
    show(f"{label} direct", direct)
    show(f"{label} via proxy", proxied)
    print(
        f"{'':<22} added p50={pct(proxied, 50) - pct(direct, 50):6.2f} ms  "
        f"p99={pct(proxied, 99) - pct(direct, 99):6.2f} ms  "
        f"(direct p99={pct(direct, 99):.2f}, proxy p99={pct(proxied, 99):.2f})"
    )


async def egress(levels: list[str], n: int, mib: int, trials: int) -> None:
    from ephemeral.sandbox import registry

    class Server(ThreadingHTTPServer):
        request_queue_size = 512  # the direct CONNECT loop opens sockets faster than it serves

    up = Upstream()
    server = Server(("127.0.0.1", 0), _handler(up))
    up.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    blob, blob_port = script_server(BLOB, str(mib))
    relay, relay_port = script_server(RELAY, str(blob_port))
    args = ["127.0.0.1", str(up.port), str(blob_port), str(n), str(mib)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "client.py"
            script.write_text(CLIENT)
            host = subprocess.run(
                ["python3", str(script), "direct", *args],
                capture_output=True,
                text=True,
                check=True,
            )
            direct = json.loads(host.stdout)
            settings = Settings.load(
                state_dir=Path(tmp) / "state",
                use_prefect=False,
                broker_allow_private_hosts=True,
                egress_max_bytes=(trials + 2) * (mib + 1) << 20,  # the default cap is 1 GiB
            )
            runtime = await Runtime.start(settings)
            try:
                for level in levels:
                    why = await registry.probe_level(level, settings)
                    if why is not None:
                        print(f"\n== egress on {level}: skipped ({why})")
                        continue
                    request = RunRequest(
                        prompt="bench",
                        model="replay/sandbox-proof",
                        web=True,
                        shell=True,
                        isolation=level,
                        max_cost_micros=5_000_000,
                        timeout_seconds=3600,
                    )
                    row, _ = await runtime.admit(await runtime.local_org(), request)
                    runtime.taken = {row.id}  # driven here, not by an executor: not orphaned
                    agent = await runtime.engine.build(row.id)
                    await agent.provision()
                    try:
                        assert agent.sandbox is not None
                        await agent.sandbox.put_file("client.py", CLIENT.encode())
                        await agent.sandbox.put_file("loopback.py", GUEST_LOOPBACK.encode())
                        inside = await agent.sandbox.exec(
                            ["python3", "loopback.py", str(n), str(mib)],
                            timeout=600,
                            max_output=1 << 20,
                        )
                        if inside.exit_code != 0:
                            why = inside.stderr[-500:]
                            print(f"\n== egress on {level}: loopback failed: {why}")
                            continue
                        loopback = json.loads(inside.stdout)
                        res = await agent.sandbox.exec(
                            ["python3", "client.py", "proxy", *args, str(settings.egress_port)],
                            timeout=600,
                            max_output=1 << 20,
                        )
                        if res.exit_code != 0:
                            print(f"\n== egress on {level}: client failed: {res.stderr[-500:]}")
                            continue
                        proxied = json.loads(res.stdout)
                        # One 64 MiB transfer swings by a third from one moment to the next on
                        # this box: more of each, direct and proxied taken in turn.
                        d_rates, p_rates = [_rate(direct)], [_rate(proxied)]
                        r_rates = [_rate(await _host_blob(script, args, relay_port))]
                        cpu = {"host": 0.0, "sandbox": 0.0}
                        for _ in range(trials - 1):
                            d_rates.append(_rate(await _host_blob(script, args)))
                            r_rates.append(_rate(await _host_blob(script, args, relay_port)))
                            before = _cpu_now(blob.pid)
                            res = await agent.sandbox.exec(
                                [
                                    "python3",
                                    "client.py",
                                    "proxy",
                                    *args,
                                    str(settings.egress_port),
                                    "blob",
                                ],
                                timeout=600,
                                max_output=1 << 20,
                            )
                            after = _cpu_now(blob.pid)
                            for k in cpu:
                                cpu[k] += after[k] - before[k]
                            p_rates.append(_rate(json.loads(res.stdout)))
                    finally:
                        await agent.teardown()
                        agent.exit = agent.exit or exits.succeeded()
                        await agent.settle()
                    print(f"\n== egress on {level} (n={n}, {mib} MiB through one tunnel)")
                    show_pair("HTTP round trip", direct["http_ms"], proxied["http_ms"])
                    show("HTTP round trip guest loopback", loopback["http_ms"])
                    show_pair("CONNECT setup", direct["connect_ms"], proxied["connect_ms"])
                    d, p, g = pct(d_rates, 50), pct(p_rates, 50), _rate(loopback)
                    print(
                        f"throughput (p50 of {trials}) direct={d:8.1f} MiB/s  "
                        f"via proxy={p:8.1f} MiB/s  direct/proxy={d / p:5.2f}x  "
                        f"guest loopback={g:8.1f} MiB/s"
                    )
                    r = pct(r_rates, 50)
                    print(
                        f"{'':<22} direct {min(d_rates):.1f}-{max(d_rates):.1f}, "
                        f"via proxy {min(p_rates):.1f}-{max(p_rates):.1f} MiB/s"
                    )
                    print(
                        f"{'':<22} relay floor (2 processes, a pipe, no proxy) p50={r:.1f} MiB/s "
                        f"({min(r_rates):.1f}-{max(r_rates):.1f}): direct/relay={d / r:.2f}x, "
                        f"relay/proxy={r / p:.2f}x"
                    )
                    if trials > 1:
                        moved = (trials - 1) * mib
                        print(
                            f"{'':<22} CPU per MiB proxied: host {cpu['host'] / moved * 1e3:.2f} "
                            f"ms, sandbox (agent, runtime; not the client) "
                            f"{cpu['sandbox'] / moved * 1e3:.2f} ms"
                        )
            finally:
                await runtime.close()
    finally:
        server.shutdown()
        for proc in (blob, relay):
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--egress-n", type=int, default=200)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--levels", default="namespaces,gvisor")
    parser.add_argument("--trials", type=int, default=5, help="tunnel transfers each way")
    ns = parser.parse_args()
    asyncio.run(main(ns.n))
    asyncio.run(egress(ns.levels.split(","), ns.egress_n, ns.mib, ns.trials))
