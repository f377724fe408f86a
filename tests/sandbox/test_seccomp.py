"""The namespaces driver's seccomp allowlist, from inside real sandboxes.

Each syscall family the red team reached is called through ctypes ``syscall(NR, ...)`` by
python3 in the sandbox, and its errno is checked. Normal workloads (fork/exec, threads, pipes,
sockets on loopback, a gcc-compiled static program) must still work; the conformance suite
covers the rest.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ephemeral.sandbox import registry
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.settings import Settings
from tests.drivers import unavailable

# x86_64 numbers; every call is made with arguments that would succeed (or fail with another
# errno than EPERM/ENOSYS) if the filter let it through.
PROBE = textwrap.dedent(r"""
    import ctypes, errno, json, os, socket
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def sys(nr, *args):
        rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_ulong(a) for a in args])
        e = ctypes.get_errno()
        if nr == 56 and rc == 0:  # a clone child: never run the rest
            os._exit(0)
        return errno.errorcode.get(e, str(e)) if rc == -1 else "ok"
    out = {
        "open_tree": sys(428, 0xFFFFFF9C, 0, 0),
        "open_tree_attr": sys(467, 0xFFFFFF9C, 0, 0, 0, 0),
        "modify_ldt": sys(154, 0, 0, 0),
        "personality(READ_IMPLIES_EXEC)": sys(135, 0x0400000),
        "personality(query)": sys(135, 0xFFFFFFFF),
        "kcmp": sys(312, os.getpid(), os.getpid(), 0, 0, 0),
        "pidfd_getfd": sys(438, 0, 0, 0),
        "memfd_secret": sys(447, 0),
        "ptrace(TRACEME)": sys(101, 0, 0, 0, 0),
        "process_vm_readv": sys(310, os.getpid(), 0, 0, 0, 0, 0),
        "unshare(NEWUSER)": sys(272, 0x10000000),
        "setns": sys(308, 0, 0),
        "clone(NEWUSER)": sys(56, 0x10000000 | 17, 0, 0, 0, 0),
        "clone3": sys(435, 0, 0),
        "io_uring_setup": sys(425, 1, 0),
        "bpf": sys(321, 0, 0, 0),
        "perf_event_open": sys(298, 0, 0, -1 & 0xFFFFFFFF, -1 & 0xFFFFFFFF, 0),
        "userfaultfd": sys(323, 0),
        "keyctl": sys(250, 0, 0, 0, 0),
        "mount": sys(165, 0, 0, 0, 0, 0),
        "ioctl(TIOCSTI)": sys(16, 0, 0x5412, 0),
        "ioctl(TIOCSTI, high bits)": sys(16, 0, 0x100005412, 0),
        "ioctl(FIONREAD)": sys(16, 0, 0x541B, 0),
        "socket(AF_VSOCK)": sys(41, 40, 1, 0),
        "socket(AF_PACKET)": sys(41, 17, 3, 0),
        "socket(AF_NETLINK, KOBJECT_UEVENT)": sys(41, 16, 2, 15),
        "socket(AF_NETLINK, ROUTE)": sys(41, 16, 2, 0),
        "socket(AF_NETLINK, AUDIT)": sys(41, 16, 3, 9),
        "socket(AF_INET)": sys(41, 2, 1, 0),
        "socket(AF_INET6)": sys(41, 10, 2, 0),
        "socket(AF_UNIX)": sys(41, 1, 1, 0),
        "socketpair(AF_INET)": sys(53, 2, 1, 0, 0),
    }
    print(json.dumps(out))
""")

REFUSED = {
    "open_tree": "EPERM",
    "open_tree_attr": "EPERM",
    "modify_ldt": "EPERM",
    "personality(READ_IMPLIES_EXEC)": "EPERM",
    "kcmp": "EPERM",
    "pidfd_getfd": "EPERM",
    "memfd_secret": "EPERM",
    "ptrace(TRACEME)": "EPERM",
    "process_vm_readv": "EPERM",
    "unshare(NEWUSER)": "EPERM",
    "setns": "EPERM",
    "clone(NEWUSER)": "EPERM",
    "clone3": "ENOSYS",
    "io_uring_setup": "EPERM",
    "bpf": "EPERM",
    "perf_event_open": "EPERM",
    "userfaultfd": "EPERM",
    "keyctl": "EPERM",
    "mount": "EPERM",
    "ioctl(TIOCSTI)": "EPERM",
    "ioctl(TIOCSTI, high bits)": "EPERM",
    "socket(AF_VSOCK)": "EPERM",
    "socket(AF_PACKET)": "EPERM",
    "socket(AF_NETLINK, KOBJECT_UEVENT)": "EPERM",
    "socket(AF_NETLINK, AUDIT)": "EPROTONOSUPPORT",  # as without audit: useradd carries on
    "socketpair(AF_INET)": "EPERM",
}
ALLOWED = [
    "personality(query)",
    "ioctl(FIONREAD)",
    "socket(AF_NETLINK, ROUTE)",
    "socket(AF_INET)",
    "socket(AF_INET6)",
    "socket(AF_UNIX)",
]

STATIC_C = r"""
#include <pthread.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>
static void *work(void *arg) { return arg; }
int main(void) {
    pthread_t t; void *r;
    if (pthread_create(&t, NULL, work, (void *)42) || pthread_join(t, &r)) return 2;
    if (r != (void *)42) return 2;
    int fds[2]; if (pipe(fds)) return 3;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 1); execl("/bin/echo", "echo", "from-child", (char *)0); _exit(9);
    }
    close(fds[1]); char buf[64] = {0}; read(fds[0], buf, sizeof buf - 1);
    int st; waitpid(pid, &st, 0);
    printf("static ok %s", buf);
    return WEXITSTATUS(st);
}
"""


@pytest.fixture
async def sbx(sandbox_settings: Settings, rootfs: Path) -> AsyncIterator[Sandbox]:
    why = await registry.probe_level("namespaces", sandbox_settings)
    if why is not None:
        unavailable(f"namespaces cannot run here: {why}", "namespaces")
    made = await registry.get_driver("namespaces", sandbox_settings).create(
        owner="test", limits=Limits()
    )
    yield made
    await made.destroy()


async def test_each_syscall_family_is_refused(sbx: Sandbox) -> None:
    res = await sbx.exec(["python3", "-c", PROBE], timeout=30)
    assert res.exit_code == 0, res.stderr
    got = json.loads(res.stdout)
    wrong = {k: (got[k], want) for k, want in REFUSED.items() if got[k] != want}
    assert not wrong, f"got, wanted: {wrong}"
    # allowed: the kernel answers (ok, or its own errno for the dummy arguments)
    refused = {k: got[k] for k in ALLOWED if got[k] in ("EPERM", "ENOSYS")}
    assert not refused, refused


async def test_another_abi_kills_the_process(sbx: Sandbox) -> None:
    # getpid through the x32 ABI: a number the allowlist never sees as "getpid"
    x32 = "import ctypes; ctypes.CDLL(None).syscall(0x40000000 | 39); print('survived')"
    res = await sbx.exec(["python3", "-c", x32], timeout=30)
    assert res.exit_code == 128 + 31 or res.exit_code == -31, (res.exit_code, res.stdout)
    assert "survived" not in res.stdout


async def test_the_worker_cannot_open_the_agents_memory(sbx: Sandbox) -> None:
    res = await sbx.exec(
        ["python3", "-c", "open('/proc/1/mem', 'r+b'); print('opened')"], timeout=30
    )
    assert "opened" not in res.stdout and res.exit_code != 0


async def test_normal_workloads_still_run(sbx: Sandbox) -> None:
    script = textwrap.dedent("""
        import socket, subprocess, threading, os, sys
        srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
        def serve():
            c, _ = srv.accept(); c.sendall(c.recv(10).upper()); c.close()
        threading.Thread(target=serve).start()
        c = socket.create_connection(srv.getsockname()); c.sendall(b"ping")
        got = c.recv(10)
        out = subprocess.run(["sh", "-c", "echo $((6*7)) | cat"], capture_output=True, text=True)
        # AI_ADDRCONFIG makes glibc list interfaces over NETLINK_ROUTE
        ai = socket.getaddrinfo("127.0.0.1", 80, flags=socket.AI_ADDRCONFIG)[0][0].name
        print(got.decode(), out.stdout.strip(), ai)
    """)
    res = await sbx.exec(["python3", "-c", script], timeout=30)
    assert res.exit_code == 0, res.stderr
    assert res.stdout.split() == ["PING", "42", "AF_INET"], res.stdout


async def test_a_gcc_compiled_static_program_runs(sbx: Sandbox, tmp_path: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed on the host (it builds the test program)")
    src = tmp_path / "prog.c"
    src.write_text(STATIC_C)
    binary = tmp_path / "prog"
    build = subprocess.run(
        [gcc, "-static", "-O1", "-pthread", "-o", str(binary), str(src)],
        capture_output=True,
        text=True,
        check=False,
    )
    if build.returncode != 0 and "cannot find -lc" in build.stderr:
        pytest.skip("no static libc on the host (libc6-dev)")
    assert build.returncode == 0, build.stderr
    await sbx.put_file("prog", binary.read_bytes(), 0o755)
    res = await sbx.exec(["./prog"], timeout=30)
    assert (res.exit_code, res.stdout) == (0, "static ok from-child\n"), res.stderr
