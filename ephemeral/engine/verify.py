"""Where and with what verify runs: an environment the agent could not shape (issue 18).

The agent's commands run as the worker and may write anything the worker can: its home, /tmp,
the scratch directory. A grader that read any of it at start (a `pytest` in the user site, a
`.pth`, `PYTHONPATH` or `BASH_ENV` from a profile) would grade what the agent chose. So, after
the agent's last turn and ``kill_all`` (no process of the worker is left):

1. :data:`VERIFY_HOME` and :data:`VERIFY_DIR` are removed and made again, empty, by the worker;
   nothing else runs then, so nothing the agent left there survives;
2. the run's ``verify_files`` are put under :data:`VERIFY_DIR`: files no command of the agent
   could ever read (they did not exist while it ran), like Harbor's ``/tests``;
3. each verify command runs with ``sh -c`` (neither a login nor an interactive shell: no
   profile or rc file is read) in :func:`environment`: ``HOME`` and ``TMPDIR`` in the fresh
   home, no user site (``PYTHONNOUSERSITE``), ``PATH`` of the image's read-only directories,
   and no variable that makes a shell or an interpreter load a file from a path the worker
   can write. The image's system site-packages are read-only on every level, so a
   ``sitecustomize``, ``usercustomize`` or ``.pth`` can only come from the image.

What stays the agent's is its work: verify runs in the working directory, and code there runs
in the grader's process when the grader imports it (``python3 -m X`` puts the directory first
on ``sys.path``; pytest loads a ``conftest.py`` under its rootdir). docs/security.md says so.
"""

from __future__ import annotations

from ephemeral import errors
from ephemeral.sandbox.base import Sandbox

VERIFY_DIR = "/tmp/verify"  # the run's verify_files, put there after kill_all
VERIFY_HOME = "/tmp/.verify-home"  # HOME (and TMPDIR under it) of every verify command
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"  # the guest agent's own PATH
# What the worker can write in every sandbox (the rest of the image is read-only); a relative
# or empty entry is the working directory, which it can write too.
WRITABLE = ("/tmp", "/var/tmp", "/home", "/run", "/dev", "/proc", "/root")
# Variables naming files or search paths that a shell, Python or the loader reads at start.
LOADS = frozenset(
    {
        "BASH_ENV",
        "ENV",
        "PYTHONPATH",
        "PYTHONSTARTUP",
        "PYTHONHOME",
        "PYTHONUSERBASE",
        "PYTHONPYCACHEPREFIX",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LD_AUDIT",
        "PERL5LIB",
        "PERL5OPT",
        "RUBYLIB",
        "RUBYOPT",
        "NODE_PATH",
        "NODE_OPTIONS",
        "GIT_CONFIG_GLOBAL",
        "XDG_CONFIG_HOME",
        "XDG_DATA_HOME",
        "XDG_CACHE_HOME",
    }
)
_RESET = (
    f"rm -rf -- {VERIFY_DIR} {VERIFY_HOME} && mkdir -m 0755 -- {VERIFY_DIR} "
    f"&& mkdir -m 0700 -- {VERIFY_HOME} {VERIFY_HOME}/tmp"
)


def _read_only(entry: str) -> bool:
    return entry.startswith("/") and not any(
        entry == root or entry.startswith(root + "/") for root in WRITABLE
    )


def environment(image_env: dict[str, str], egress_env: dict[str, str]) -> dict[str, str]:
    """The environment of a verify command: the image's, less what could load a file the
    worker can write, with the proxy's variables and a home of its own."""
    env: dict[str, str] = {}
    for name, value in image_env.items():
        if name == "PATH":
            continue
        if name in LOADS and not all(_read_only(e) for e in value.split(":")):
            continue
        env[name] = value
    path = [e for e in image_env.get("PATH", SYSTEM_PATH).split(":") if _read_only(e)]
    env.update(egress_env)
    env.update(
        {
            "PATH": ":".join(path) or SYSTEM_PATH,
            "HOME": VERIFY_HOME,
            "TMPDIR": f"{VERIFY_HOME}/tmp",
            "PYTHONNOUSERSITE": "1",
            "EPHEMERAL_VERIFY_DIR": VERIFY_DIR,
        }
    )
    return env


async def reset(sandbox: Sandbox, timeout: float) -> None:
    """Step 1 above. Call it after ``kill_all`` only: a process of the agent still running
    could plant something in the fresh home or read the verify files put after it."""
    res = await sandbox.exec(_RESET, cwd="/", timeout=max(0.1, timeout), max_output=4096)
    if res.exit_code != 0 or res.timed_out:
        why = "timed out" if res.timed_out else f"exit {res.exit_code}: {res.stderr[-200:]}"
        raise errors.SandboxError(f"verify: could not make a fresh home ({why})")
