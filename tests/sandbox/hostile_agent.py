"""A lying, broken or silent guest agent, for the host side's hostility tests.

Usage: python hostile_agent.py MODE. Speaks the real framing on stdin/stdout, then misbehaves.
"""

from __future__ import annotations

import base64
import json
import sys
import time

HELLO = {
    "type": "hello",
    "protocol": 2,
    "workdir": "/tmp/ephemeral-run-abc123/scratch",
    "pid": 7,
    "uid": 1000,
}


def send(obj: object) -> None:
    body = json.dumps(obj).encode()
    sys.stdout.buffer.write(len(body).to_bytes(4, "big") + body)
    sys.stdout.buffer.flush()


def raw(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def recv() -> dict:
    header = sys.stdin.buffer.read(4)
    if len(header) < 4:
        sys.exit(0)
    return json.loads(sys.stdin.buffer.read(int.from_bytes(header, "big")))


def ok_exec(rid: str, **over: object) -> dict:
    reply = {
        "id": rid,
        "ok": True,
        "exit_code": 0,
        "stdout": "",
        "stderr": "",
        "truncated": False,
        "timed_out": False,
        "duration_ms": 1,
    }
    reply.update(over)
    return reply


def flood_stderr() -> None:
    """Say hello, then write to the runtime's stderr (the host's side channel) as fast as it can
    be read, while still answering requests like a good agent."""
    import os
    import threading

    def flood() -> None:
        line = b"E" * 65535 + b"\n"
        while True:
            try:
                os.write(2, line)
            except OSError:
                return

    threading.Thread(target=flood, daemon=True).start()
    send(HELLO)
    while True:
        req = recv()
        if req["op"] == "exec":
            send(ok_exec(req["id"], stdout=base64.b64encode(b"hi\n").decode()))
        else:
            send({"id": req["id"], "ok": True})


def absurd() -> None:
    """Answer every request, with the largest numbers the models let through, then with one
    past them (2^63 ms, the reply that once cost a run its records)."""
    execs = 0
    while True:
        req = recv()
        rid = req["id"]
        if req["op"] == "exec":
            execs += 1
            if execs == 1:
                send(ok_exec(rid, exit_code=511, duration_ms=7 * 24 * 3600 * 1000))
            else:
                send(ok_exec(rid, duration_ms=1 << 63))
        elif req["op"] == "put":
            send({"id": rid, "ok": True, "size": len(base64.b64decode(req["data"]))})
        elif req["op"] == "reseed":
            send({"id": rid, "ok": True, "credited": True})
        else:
            send({"id": rid, "ok": True})


def main(mode: str) -> None:
    if mode == "silent":
        time.sleep(3600)
    if mode == "huge_frame":
        raw((0x7FFFFFFF).to_bytes(4, "big") + b"{")
        time.sleep(3600)
    if mode == "garbage":
        raw((5).to_bytes(4, "big") + b"\xff\xfe{]x")
        time.sleep(3600)
    if mode == "not_object":
        send([1, 2, 3])
        time.sleep(3600)
    if mode == "bad_hello":
        send({**HELLO, "workdir": "/etc"})
        time.sleep(3600)
    if mode == "old_protocol":
        send({**HELLO, "protocol": 99})
        time.sleep(3600)
    if mode == "dies_mid_frame":
        raw((100).to_bytes(4, "big") + b'{"type": "he')
        sys.exit(0)
    if mode == "flood_stderr":
        flood_stderr()
    send(HELLO)
    if mode == "absurd":
        absurd()
    if mode == "good":
        while True:
            req = recv()
            if req["op"] == "exec":
                send(ok_exec(req["id"], stdout=base64.b64encode(b"hi\n").decode()))
            elif req["op"] == "kill_all":
                send({"id": req["id"], "ok": True, "killed": 0})
            else:
                send({"id": req["id"], "ok": True})
    req = recv()
    rid = req["id"]
    if mode == "mute_after_hello":
        time.sleep(3600)
    elif mode == "wrong_id":
        send(ok_exec("0" * 32 if rid != "0" * 32 else "1" * 32))
    elif mode == "int_id":
        send(ok_exec(1))
    elif mode in ("replay", "unasked"):
        first = ok_exec(rid, stdout=base64.b64encode(b"first\n").decode())
        send(first)
        if mode == "unasked":  # a frame nobody asked for, waiting in the channel
            send(ok_exec(rid, stdout=base64.b64encode(b"FORGED\n").decode()))
        second = recv()
        send(first if mode == "replay" else ok_exec(second["id"]))
    elif mode == "oversize_stdout":
        send(ok_exec(rid, stdout=base64.b64encode(b"a" * 1500).decode()))
    elif mode == "bad_base64":
        send(ok_exec(rid, stdout="!!!not base64!!!"))
    elif mode == "extra_field":
        send(ok_exec(rid, evil="x"))
    elif mode == "string_exit_code":
        send(ok_exec(rid, exit_code="0"))
    elif mode == "flood_frame":
        send(ok_exec(rid, stderr="A" * 200_000))
    elif mode == "huge_duration":
        send(ok_exec(rid, duration_ms=1 << 63))
    elif mode == "deep_nesting":
        body = b'{"id": "%s", "x": ' % rid.encode() + b"[" * 3000 + b"]" * 3000 + b"}"
        raw(len(body).to_bytes(4, "big") + body)
    elif mode == "huge_int":
        body = b'{"id": "%s", "ok": true, "duration_ms": 1%s}' % (rid.encode(), b"0" * 5000)
        raw(len(body).to_bytes(4, "big") + body)
    elif mode == "dies_after_request":
        sys.exit(1)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1])
