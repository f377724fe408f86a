"""``fake``: an in-memory, scripted sandbox double for API and flow tests. NOT an isolation level.

Nothing runs on the host: commands are interpreted by a tiny scripted shell over an in-memory
file table (``whoami``, ``pwd``, ``echo``, ``cat``, ``ls``, ``true``/``false``/``exit``,
``sleep``, ``curl`` that cannot resolve anything, ``>``/``>>`` redirection, ``;``/``&&``/``||``).
Tests program anything else with ``FakeDriver(responses={command: ExecResult | callable})``.
Unknown commands answer 127 like ``sh``. ``auto`` never picks it; the registry returns it only
when asked for ``fake`` by name, and every sandbox it makes says ``isolation == "fake"``. Its
lifecycle (adopt, lifetime, destroy-once, ``async with``) is the real ``SandboxBase``.
"""

from __future__ import annotations

import itertools
import posixpath
import re
import shlex
from collections.abc import Callable

from ephemeral import errors
from ephemeral.sandbox.base import ExecResult, Limits, Sandbox
from ephemeral.sandbox.lifecycle import SandboxBase

Responder = ExecResult | Callable[[str, bytes], ExecResult]
_counter = itertools.count(1)


class FakeSandbox(SandboxBase):
    def __init__(self, owner: str, limits: Limits, responses: dict[str, Responder]) -> None:
        n = next(_counter)
        super().__init__(
            sandbox_id=f"sbx_fake{n:020d}",
            isolation="fake",
            image="fake",
            runtime="fake",
            owner=owner,
            limits=limits,
        )
        self.workdir = f"/tmp/ephemeral-run-fake{n:04d}/scratch"
        self.files: dict[str, bytes] = {}
        self.commands: list[str | list[str]] = []
        self._responses = responses

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def _check(self) -> None:
        if self._destroyed:
            raise errors.SandboxError(f"sandbox {self.id} is destroyed")

    def _abs(self, path: str, cwd: str | None = None) -> str:
        base = cwd or self.workdir
        return posixpath.normpath(path if path.startswith("/") else posixpath.join(base, path))

    async def exec(
        self,
        command: str | list[str],
        *,
        stdin: bytes = b"",
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = 30.0,
        max_output: int = 64 * 1024,
        user: str | None = None,
        stdin_path: str | None = None,
    ) -> ExecResult:
        self._check()
        if stdin_path is not None:
            stdin = await self.get_file(stdin_path, 1 << 30)
        self.commands.append(command)
        text = command if isinstance(command, str) else shlex.join(command)
        scripted = self._responses.get(text)
        if scripted is not None:
            res = scripted if isinstance(scripted, ExecResult) else scripted(text, stdin)
        else:
            res = _Shell(self, stdin, env or {}, cwd, timeout).run(text)
        out, err = res.stdout.encode(), res.stderr.encode()
        truncated = res.truncated or len(out) > max_output or len(err) > max_output
        return res.model_copy(
            update={
                "stdout": out[:max_output].decode(errors="replace"),
                "stderr": err[:max_output].decode(errors="replace"),
                "truncated": truncated,
            }
        )

    async def put_file(
        self, path: str, data: bytes, mode: int = 0o644, *, user: str | None = None
    ) -> None:
        self._check()
        self.files[self._abs(path)] = bytes(data)

    async def get_file(
        self, path: str, max_bytes: int = 1 << 20, *, user: str | None = None
    ) -> bytes:
        self._check()
        p = self._abs(path)
        if p not in self.files:
            raise errors.FileNotFound(f"{path}: no such file in the sandbox")
        data = self.files[p]
        if len(data) > max_bytes:
            raise errors.PayloadTooLarge(f"{path} is {len(data)} bytes, over {max_bytes}")
        return data

    async def _teardown(self) -> None:
        self.files.clear()


class _Shell:
    """Just enough ``sh`` for scripted tests; anything else is 127, never a host call."""

    def __init__(
        self, sbx: FakeSandbox, stdin: bytes, env: dict[str, str], cwd: str | None, timeout: float
    ) -> None:
        self.sbx, self.stdin, self.env, self.timeout = sbx, stdin, env, timeout
        self.cwd = sbx._abs(cwd) if cwd else sbx.workdir
        self.out: list[str] = []
        self.err: list[str] = []

    def run(self, text: str) -> ExecResult:
        code = 0
        op = ";"
        for part in re.split(r"(;|&&|\|\||\n)", text):
            if part in (";", "&&", "||", "\n"):
                op = part
                continue
            if not part.strip() or (op == "&&" and code != 0) or (op == "||" and code == 0):
                continue
            try:
                code = self.simple(part.strip())
            except _Exit as e:
                code = e.code
                break
            except _Timeout:
                return self.result(137, timed_out=True)
        return self.result(code)

    def result(self, code: int, timed_out: bool = False) -> ExecResult:
        return ExecResult(
            exit_code=code,
            stdout="".join(self.out),
            stderr="".join(self.err),
            duration_ms=1,
            truncated=False,
            timed_out=timed_out,
        )

    def simple(self, part: str) -> int:
        try:
            words = shlex.split(part)
        except ValueError as exc:
            self.err.append(f"sh: 1: Syntax error: {exc}\n")
            return 2
        redirect: tuple[str, str] | None = None
        for i, w in enumerate(words):
            if w in (">", ">>") and i + 1 < len(words):
                redirect = (w, words[i + 1])
                words = words[:i] + words[i + 2 :]
                break
        out_before = len(self.out)
        code = self.command(words)
        if redirect is not None:
            text = "".join(self.out[out_before:])
            del self.out[out_before:]
            path = self.sbx._abs(redirect[1], self.cwd)
            old = self.sbx.files.get(path, b"") if redirect[0] == ">>" else b""
            self.sbx.files[path] = old + text.encode()
        return code

    def command(self, words: list[str]) -> int:
        if not words:
            return 0
        name, args = words[0], words[1:]
        files = self.sbx.files
        if name == "true":
            return 0
        if name == "false":
            return 1
        if name == "exit":
            raise _Exit(int(args[0]) if args and args[0].isdigit() else 0)
        if name == "whoami":
            self.out.append("worker\n")
            return 0
        if name == "id":
            self.out.append("uid=1000(worker) gid=1000(worker) groups=1000(worker)\n")
            return 0
        if name == "pwd":
            self.out.append(self.cwd + "\n")
            return 0
        if name == "echo":
            self.out.append(" ".join(args) + "\n")
            return 0
        if name == "cat":
            if not args:
                self.out.append(self.stdin.decode(errors="replace"))
                return 0
            code = 0
            for a in args:
                p = self.sbx._abs(a, self.cwd)
                if p in files:
                    self.out.append(files[p].decode(errors="replace"))
                else:
                    self.err.append(f"cat: {a}: No such file or directory\n")
                    code = 1
            return code
        if name == "ls":
            targets = [a for a in args if not a.startswith("-")] or [self.cwd]
            code = 0
            for a in targets:
                p = self.sbx._abs(a, self.cwd)
                if p in files:
                    self.out.append(a + "\n")
                    continue
                kids = sorted(
                    {
                        f[len(p) + 1 :].split("/")[0]
                        for f in files
                        if f.startswith(p.rstrip("/") + "/")
                    }
                )
                if kids or p in (self.cwd, "/tmp"):
                    self.out.append("".join(k + "\n" for k in kids))
                else:
                    self.err.append(f"ls: cannot access '{a}': No such file or directory\n")
                    code = 2
            return code
        if name == "sleep":
            if args and float(args[0]) > self.timeout:
                raise _Timeout
            return 0
        if name == "curl":
            host = next((a.split("/")[2] for a in args if "://" in a), "")
            self.err.append(f"curl: (6) Could not resolve host: {host}\n")
            return 6
        self.err.append(f"sh: 1: {name}: not found\n")
        return 127


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class _Timeout(Exception):
    pass


class FakeDriver:
    """Makes :class:`FakeSandbox` instances; keeps them for tests to inspect."""

    isolation = "fake"

    def __init__(self, responses: dict[str, Responder] | None = None) -> None:
        self.responses: dict[str, Responder] = dict(responses or {})
        self.sandboxes: list[FakeSandbox] = []

    async def probe(self) -> str | None:
        return None

    async def create(self, *, owner: str, limits: Limits) -> Sandbox:
        sbx = FakeSandbox(owner, limits, self.responses)
        sbx._start_lifetime()
        self.sandboxes.append(sbx)
        return sbx
