"""Runs inside a sandbox as the worker: every way we know to reach the guest agent.

    python3 forge_probe.py N forge   write forged reply frames into the agent's channel
    python3 forge_probe.py N probe   only report what the worker can do to the agent

Prints one JSON object per attempt to stderr: {"how": ..., "target": ..., "ok": bool, "err": ...}.
"ok": true means the attempt worked (an isolation failure). Stdlib only (the image's python).
"""

import base64
import ctypes
import json
import os
import signal
import sys

FORGED = b"FORGED: all tests passed\n"
SYS_PTRACE, SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 101, 434, 438
PTRACE_ATTACH, PTRACE_DETACH = 16, 17
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def report(how, target, ok, err=""):
    sys.stderr.write(json.dumps({"how": how, "target": str(target), "ok": ok, "err": err}) + "\n")


def frames(count):
    """Reply frames for every id the agent might be answering: small ints, a zero nonce."""
    out = b""
    for rid in [*range(1, count + 1), "0" * 32]:
        body = json.dumps(
            {
                "id": rid,
                "ok": True,
                "exit_code": 0,
                "stdout": base64.b64encode(FORGED).decode(),
                "stderr": "",
                "truncated": False,
                "timed_out": False,
                "duration_ms": 1,
            }
        ).encode()
        out += len(body).to_bytes(4, "big") + body
    return out


def agent_pids():
    pids = {1}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as fh:
                    if b"agent.py" in fh.read():
                        pids.add(int(name))
            except OSError:
                continue
    pids.discard(os.getpid())
    return sorted(pids)


def try_fd(how, target, fd, forge, payload):
    if forge:
        try:
            os.set_blocking(fd, False)
            os.write(fd, payload)
            report(how + " write", target, True)
        except OSError as exc:
            report(how + " write", target, False, exc.strerror)
    else:
        report(how, target, True)
    os.close(fd)


def main(count, forge):
    payload = frames(count)
    for pid in agent_pids():
        fddir = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fddir)
            report("listdir", fddir, True)
        except OSError as exc:
            report("listdir", fddir, False, exc.strerror)
            names = [str(n) for n in range(0, 16)]
        for n in names:
            path = f"{fddir}/{n}"
            try:
                if os.readlink(path) == "/dev/null":
                    continue  # reopening /dev/null reaches nothing (gVisor allows it)
            except OSError:
                pass
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                report("open", path, False, exc.strerror)
                continue
            try_fd("open", path, fd, forge, payload)
        pidfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
        if pidfd < 0:
            report("pidfd_open", pid, False, os.strerror(ctypes.get_errno()))
        else:
            for n in range(0, 16):
                fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, n, 0)
                if fd < 0:
                    report("pidfd_getfd", f"{pid}:{n}", False, os.strerror(ctypes.get_errno()))
                else:
                    try_fd("pidfd_getfd", f"{pid}:{n}", fd, forge, payload)
            os.close(pidfd)
        if libc.syscall(SYS_PTRACE, PTRACE_ATTACH, pid, 0, 0) == 0:
            report("ptrace", pid, True)
            libc.syscall(SYS_PTRACE, PTRACE_DETACH, pid, 0, 0)
        else:
            report("ptrace", pid, False, os.strerror(ctypes.get_errno()))
        for what in ("mem", "environ"):
            try:
                with open(f"/proc/{pid}/{what}", "rb") as fh:
                    fh.read(1)
                report("read " + what, pid, True)
            except OSError as exc:
                report("read " + what, pid, False, exc.strerror)
        try:
            os.kill(pid, signal.SIGSTOP)
            report("signal", pid, True)
            os.kill(pid, signal.SIGCONT)
        except OSError as exc:
            report("signal", pid, False, exc.strerror)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2, sys.argv[2:3] == ["forge"])
