"""The guest is hostile (issue 13): a command must not be able to forge its own result, reach
the agent, weaken the sandbox by making it fail, observe other tenants, or see the host.

Each test runs on every driver the ``driver`` fixture offers here (microvm-tcg in the slow set),
except where a level has no such surface (said in the test).
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import textwrap
from pathlib import Path

import pytest

from ephemeral import errors
from ephemeral.sandbox import handles, namespaces, process, registry
from ephemeral.sandbox.base import Limits, Sandbox
from ephemeral.sandbox.process import ProcessSandbox, new_handle
from ephemeral.sandbox.uid_ranges import RANGE_BASE
from ephemeral.settings import Settings
from tests.drivers import unavailable
from tests.sandbox.conftest import Factory, _availability_of

pytestmark = pytest.mark.sandbox

PROBE = Path(__file__).with_name("forge_probe.py").read_bytes()


def _attempts(stderr: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def _succeeded(sbx: Sandbox, attempts: list[dict[str, object]]) -> list[dict[str, object]]:
    # gVisor lists /proc/1/fd and shows /proc/1/environ to other uids (no ptrace check there);
    # both only inform: opening the fds, ptrace, mem and signals are refused.
    informs = {"listdir", "read environ"} if sbx.isolation == "gvisor" else set()
    return [a for a in attempts if a["ok"] and a["how"] not in informs]


async def test_a_command_cannot_forge_its_own_result(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    await sbx.put_file("f.py", PROBE)
    res = await sbx.exec("python3 f.py 2 forge; echo REAL; exit 42", timeout=60)
    attempts = _attempts(res.stderr)
    assert attempts, res.stderr
    assert _succeeded(sbx, attempts) == []
    assert res.exit_code == 42
    assert "REAL" in res.stdout
    assert "FORGED" not in res.stdout
    # the channel is intact: the next request gets its own, true answer
    assert (await sbx.exec("echo next")).stdout == "next\n"


async def test_the_worker_cannot_signal_ptrace_or_read_the_agent(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    await sbx.put_file("f.py", PROBE)
    res = await sbx.exec(["python3", "f.py", "2", "probe"], timeout=60)
    attempts = _attempts(res.stderr)
    kinds = {str(a["how"]) for a in attempts}
    assert {"listdir", "ptrace", "read mem", "signal"} <= kinds, kinds
    assert kinds & {"pidfd_open", "pidfd_getfd"}, kinds
    assert _succeeded(sbx, attempts) == []
    # the agent is root of the sandbox, the worker is not
    agent = await sbx.exec("ps -o uid= -p 1 2>/dev/null || true")
    if agent.stdout.strip():
        assert agent.stdout.strip() in ("0", "root")
    caps = await sbx.exec("grep -E '^Cap(Inh|Prm|Eff|Amb)' /proc/self/status")
    assert all(line.split()[1] == "0000000000000000" for line in caps.stdout.splitlines())
    # the agent's channel devices (microVM virtio ports) belong to root alone
    ports = await sbx.exec(
        "for f in /dev/vport* /dev/virtio-ports/*; do "
        '[ -e "$f" ] && { [ -r "$f" ] || [ -w "$f" ]; } && echo "OPEN $f"; done; true'
    )
    assert "OPEN" not in ports.stdout, ports.stdout
    fds = await sbx.exec("ls /proc/self/fd")
    assert sorted(int(n) for n in fds.stdout.split()) <= [0, 1, 2, 3], fds.stdout


async def test_kill_all_leaves_no_worker_process(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    started = await sbx.exec(
        "sleep 1000 </dev/null >/dev/null 2>&1 & setsid sleep 1000 </dev/null >/dev/null 2>&1 & "
        "(sleep 1000 </dev/null >/dev/null 2>&1 &); true"
    )
    assert started.exit_code == 0
    before = await sbx.exec("ps -eo comm= | grep -c '^sleep$'")
    assert int(before.stdout) == 3
    killed = await sbx.kill_all()  # type: ignore[attr-defined]
    assert killed >= 3
    after = await sbx.exec(
        'ps -eo uid=,comm= | awk \'$1 == 1000 && $2 != "ps" && $2 != "sh" && $2 != "awk"\''
    )
    assert after.stdout.split() == [], after.stdout
    assert (await sbx.exec("echo alive")).stdout == "alive\n"


# Rewrites the "verifier's" file whenever it holds anything but 1; ignores every catchable signal.
WRITER = (
    'trap "" TERM HUP INT QUIT USR1 USR2; '
    'while :; do [ "$(cat /tmp/grade/reward 2>/dev/null)" = 1 ] || echo 1 > /tmp/grade/reward '
    "2>/dev/null; sleep 0.02; done"
)
WRITERS = {  # the last word of each one's command line: who starts it, and how
    "setsid-writer": ("worker", "setsid sh -c {w} setsid-writer"),
    "daemon-writer": ("worker", "(setsid sh -c {w} daemon-writer &)"),
    "term-ignoring-writer": ("worker", "sh -c {w} term-ignoring-writer"),
    "root-writer": ("root", "setsid sh -c {w} root-writer"),
    # a writer whose parent stays alive: never an orphan of the agent's
    "root-parent": ("root", "(setsid sh -c {p} root-parent &)"),
}


async def _running(sbx: Sandbox) -> set[str]:
    res = await sbx.exec("ps -eo args=", user="root")
    return {line.split()[-1] for line in res.stdout.splitlines() if line.strip()}


async def test_kill_all_leaves_no_process_of_any_session_or_user(make_sandbox: Factory) -> None:
    """Issue 35, finding 6: between phases nothing of the one before may run. A setsid writer,
    a double-forked daemon, root's own writers (one under a parent that stays alive) and one
    that ignores SIGTERM all rewrite the grader's file; after kill_all none is left and the file
    keeps what the grader wrote."""
    sbx = await make_sandbox()
    w = shlex.quote(WRITER)
    p = shlex.quote(f"sh -c {w} root-grandchild-writer; sleep 1000")
    made = await sbx.exec(
        "mkdir -m 1777 /tmp/grade && echo 0 > /tmp/grade/reward && chmod 666 /tmp/grade/reward",
        user="root",
    )
    assert made.exit_code == 0, made.stderr
    for user, launch in WRITERS.values():
        res = await sbx.exec(
            f"{launch.format(w=w, p=p)} </dev/null >/dev/null 2>&1 & true", user=user
        )
        assert res.exit_code == 0, res.stderr
    names = {*WRITERS, "root-grandchild-writer"}
    for _ in range(200):  # each is running once its shell has exec'd
        if names <= await _running(sbx):
            break
    assert names <= await _running(sbx)
    assert (await sbx.exec("cat /tmp/grade/reward")).stdout == "1\n"

    killed = await sbx.kill_all()  # type: ignore[attr-defined]

    assert killed >= len(names)
    assert not names & await _running(sbx)
    # what is left is the agent (pid 1 of its pid namespace; in a microVM, its init and kernel
    # threads too), besides this ps
    left = await sbx.exec("ps -eo pid=,args= | grep -v -e 'ps -eo' -e grep", user="root")
    for line in left.stdout.splitlines():
        pid, args = line.split(None, 1)
        assert pid == "1" or "agent.py" in args or args.startswith("["), left.stdout
    # the grader writes 0 and, after as long as any writer needs 50 times over, reads 0
    graded = await sbx.exec(
        "echo 0 > /tmp/grade/reward && sleep 1 && cat /tmp/grade/reward", user="root"
    )
    assert graded.stdout == "0\n", graded


async def test_no_vsock_inside(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    if sbx.isolation.startswith("microvm"):
        pytest.skip("a VM's vsock port space is its own (the VM has no vsock device)")
    code = textwrap.dedent("""
        import socket
        try:
            s = socket.socket(40, socket.SOCK_STREAM)
            s.bind((0xFFFFFFFF, 4242))
            print("BOUND")
        except OSError as exc:
            print("refused", exc.errno)
    """)
    res = await sbx.exec(["python3", "-c", code])
    assert res.stdout.startswith("refused"), res.stdout + res.stderr
    assert (await sbx.exec("test -e /dev/vsock")).exit_code != 0


async def test_the_host_is_masked(make_sandbox: Factory) -> None:
    sbx = await make_sandbox()
    mountinfo = (await sbx.exec("cat /proc/self/mountinfo")).stdout
    assert mountinfo
    for leak in ("/root/", ".cache", "ephemeral/images", f"{Path.home()}/"):
        assert leak not in mountinfo, mountinfo
    assert (await sbx.exec("cat /etc/hostname")).stdout == "sandbox\n"
    assert (await sbx.exec("hostname")).stdout == "sandbox\n"
    for path in ("/proc/cmdline", "/proc/sys/kernel/random/boot_id", "/proc/loadavg"):
        inside = (await sbx.exec(f"cat {path} 2>/dev/null; true")).stdout
        assert inside != Path(path).read_text(), path
    if sbx.isolation != "namespaces":  # namespaces shows the host's uptime (see namespaces.py)
        inside_up = float((await sbx.exec("cut -d' ' -f1 /proc/uptime")).stdout)
        assert inside_up < float(Path("/proc/uptime").read_text().split()[0]) - 1
    # /dev cannot be filled: not writable by the worker, and /dev/shm is capped
    dev = await sbx.exec("head -c 1048576 /dev/zero > /dev/fill", timeout=30)
    assert dev.exit_code != 0
    shm = await sbx.exec(
        "head -c 200000000 /dev/zero > /dev/shm/fill; stat -c %s /dev/shm/fill 2>/dev/null || "
        "echo 0",
        timeout=30,
    )
    assert int(shm.stdout.split()[-1]) <= 64 << 20
    assert (await sbx.exec("echo alive")).stdout == "alive\n"


# ---- namespaces only: start failures and the privileged mode


def _namespaces(settings: Settings) -> namespaces.NamespacesDriver:
    why = _availability_of("namespaces", settings)
    if why is not None:
        unavailable(f"namespaces cannot run here: {why}", "namespaces")
    driver = registry.get_driver("namespaces", settings)
    assert isinstance(driver, namespaces.NamespacesDriver)
    return driver


def _host_uids(sbx: Sandbox) -> set[int]:
    pids: set[int] = getattr(sbx, "host_pids", set())
    return {Path(f"/proc/{pid}").stat().st_uid for pid in pids}


async def _assert_unprivileged(sbx: Sandbox) -> None:
    assert sbx.isolation == "namespaces"
    uids = _host_uids(sbx)
    assert uids and min(uids) >= RANGE_BASE, uids
    shadow = await sbx.exec("cat /etc/shadow")
    assert shadow.exit_code != 0 and "root:" not in shadow.stdout
    # no nested user namespaces, even without the seccomp filter's help
    assert (await sbx.exec("cat /proc/sys/user/max_user_namespaces")).stdout == "0\n"


async def test_a_failed_start_never_weakens_the_next_sandbox(
    sandbox_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = _namespaces(sandbox_settings)
    limits = Limits()
    # a late hello
    monkeypatch.setattr(process, "HELLO_TIMEOUT", 0.001)
    with pytest.raises(errors.SandboxError):
        await driver.create(owner="test", limits=limits)
    monkeypatch.undo()
    # the agent dying at start
    await driver._image()
    real_agent = driver._agent_path
    driver._agent_path = "/nonexistent/agent.py"
    with pytest.raises(errors.SandboxError):
        await driver.create(owner="test", limits=limits)
    driver._agent_path = real_agent
    sbx = await driver.create(owner="test", limits=limits)
    try:
        await _assert_unprivileged(sbx)
    finally:
        await sbx.destroy()


async def test_privileged_mode_only_by_setting_and_labelled(sandbox_settings: Settings) -> None:
    assert Settings.load(use_prefect=False).namespaces_privileged is False
    _namespaces(sandbox_settings)
    settings = sandbox_settings.model_copy(update={"namespaces_privileged": True})
    driver = registry.get_driver("namespaces", settings)
    sbx = await driver.create(owner="test", limits=Limits())
    try:
        assert sbx.isolation == "namespaces-privileged"
        assert 0 in _host_uids(sbx)  # what the label warns of: the agent is host root
        assert (await sbx.exec("id -u")).stdout == "1000\n"
    finally:
        await sbx.destroy()


async def test_concurrent_sandboxes_get_distinct_host_uids(sandbox_settings: Settings) -> None:
    driver = _namespaces(sandbox_settings)
    made = await asyncio.gather(*(driver.create(owner="test", limits=Limits()) for _ in range(3)))
    try:
        uid_sets = [_host_uids(s) for s in made]
        for i, a in enumerate(uid_sets):
            for b in uid_sets[i + 1 :]:
                assert not a & b
    finally:
        for s in made:
            await s.destroy()


# ---- cross-tenant observation through the shared image

WATCH = textwrap.dedent("""
    import ctypes, os, select, struct, sys, time
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(0)
    assert fd >= 0, ctypes.get_errno()
    assert libc.inotify_add_watch(fd, b"/etc", 0x20 | 0x01) >= 0  # IN_OPEN | IN_ACCESS
    print("watching", flush=True)
    names = set()
    def drain(until):
        while time.monotonic() < until:
            r, _, _ = select.select([fd], [], [], 0.1)
            if not r:
                continue
            buf = os.read(fd, 65536)
            i = 0
            while i < len(buf):
                _wd, _mask, _cookie, n = struct.unpack_from("iIII", buf, i)
                names.add(buf[i + 16:i + 16 + n].rstrip(b"\\0").decode())
                i += 16 + n
    drain(time.monotonic() + float(sys.argv[1]))
    with open("/etc/hostname") as fh:  # our own open: proves the watch works
        fh.read()
    drain(time.monotonic() + 0.5)
    print(" ".join(sorted(names)))
""")


@pytest.mark.parametrize("other", ["gvisor", "namespaces"])
async def test_inotify_does_not_see_other_tenants(sandbox_settings: Settings, other: str) -> None:
    for iso in ("namespaces", other):
        why = _availability_of(iso, sandbox_settings)
        if why is not None:
            unavailable(f"{iso} cannot run here: {why}", iso)
    watcher = await registry.get_driver("namespaces", sandbox_settings).create(
        owner="test", limits=Limits()
    )
    actor = await registry.get_driver(other, sandbox_settings).create(owner="test", limits=Limits())
    try:
        await watcher.put_file("w.py", WATCH.encode())
        watch = asyncio.create_task(watcher.exec(["python3", "w.py", "4"], timeout=30))
        await asyncio.sleep(1.5)
        acted = await actor.exec(
            "for i in 1 2 3; do cat /etc/*.conf /etc/debian_version /etc/passwd >/dev/null; "
            "sleep 0.3; done 2>/dev/null; true"
        )
        assert acted.exit_code == 0
        seen = await watch
        lines = seen.stdout.splitlines()
        assert lines[0] == "watching", seen.stdout + seen.stderr
        names = set(lines[1].split()) if len(lines) > 1 else set()
        assert "hostname" in names, seen.stdout  # the watch itself works
        assert names == {"hostname"}, names
    finally:
        await watcher.destroy()
        await actor.destroy()


# ---- a lying agent: the sandbox is destroyed, not just the client


async def test_a_reply_nobody_asked_for_destroys_the_sandbox(tmp_path: Path) -> None:
    handle = new_handle("test", "test")
    hfile = handles.write(tmp_path, handle)
    sbx = ProcessSandbox(
        sandbox_id=handle.id,
        isolation="test",
        image="none",
        handle=handle,
        handle_file=hfile,
        cgroups=None,
        limits=Limits(),
    )
    await sbx._start([sys.executable, str(Path(__file__).with_name("hostile_agent.py")), "unasked"])
    try:
        assert (await sbx.exec(["true"], max_output=1000)).stdout == "first\n"
        with pytest.raises(errors.SandboxError, match="not in flight"):
            await sbx.exec(["true"], max_output=1000)
        assert not sbx.alive
        assert not hfile.exists()
    finally:
        await sbx.destroy()
