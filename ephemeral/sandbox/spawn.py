"""Start a sandbox's runtime with exactly its stdio pipes (and ``pass_fds``) open, on any loop.

``asyncio.create_subprocess_exec`` is only as good as the running loop's spawn. Under uvloop
(what ``ephemeral serve`` runs, through uvicorn) it ignores ``close_fds`` (uvloop's "TODO:
Implement close_fds") and libuv hands the child its stdio as socketpairs whose child ends stay
open, inheritable, at the numbers they had in the server. ``runsc run`` passes every inherited
fd on to its Sentry, which dups the guest's stdio to fds 256-258 and dies when one is taken
("unable to remap stdios, FD 256 is already in use", seen by the host as "cannot read client
sync file: waiting for sandbox to start: EOF"): in a burst the server holds hundreds of fds, so
some boots failed in ``serve`` and none in a plain asyncio loop. Under ``namespaces`` the same
leak put server sockets into the sandbox's agent.

So the runtime is started with :class:`subprocess.Popen` (``close_fds=True``: the child closes
everything but its stdio and ``pass_fds`` before exec) and real pipes, whose parent ends are
then attached to the running loop. Its exit is awaited through a pidfd, so no thread or child
watcher is involved.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Sequence

STREAM_LIMIT = 1 << 16  # what asyncio's subprocess streams use


class Child:
    """A started runtime process: ``stdin`` (writer), ``stdout``/``stderr`` (readers)."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        stdin: asyncio.StreamWriter,
        stdout: asyncio.StreamReader,
        stderr: asyncio.StreamReader,
        transports: list[asyncio.BaseTransport],
    ) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self._transports = transports

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def pipe_fds(self) -> list[int]:
        """Our ends of the stdin and stdout pipes (for ``F_SETPIPE_SZ``)."""
        return [f.fileno() for f in (self._popen.stdin, self._popen.stdout) if f is not None]

    def close_pipes(self) -> None:
        """Close our ends of the pipes (a reader paused on a flooded pipe included)."""
        for t in self._transports:
            t.close()

    async def wait(self) -> int:
        """Until the process exits (reaped); its return code."""
        code = self._popen.poll()
        if code is not None:
            return code
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return self._popen.wait()
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(pidfd, readable)
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        return self._popen.wait()


async def spawn(
    argv: Sequence[str],
    *,
    env: dict[str, str],
    pass_fds: Sequence[int] = (),
    start_new_session: bool = True,
) -> Child:
    popen = subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        close_fds=True,
        pass_fds=tuple(pass_fds),
        start_new_session=start_new_session,
        env=env,
    )
    assert popen.stdin is not None and popen.stdout is not None and popen.stderr is not None
    loop = asyncio.get_running_loop()
    transports: list[asyncio.BaseTransport] = []
    try:
        readers = []
        for pipe in (popen.stdout, popen.stderr):
            reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop)
            transport, _ = await loop.connect_read_pipe(
                lambda r=reader: asyncio.StreamReaderProtocol(r, loop=loop),  # type: ignore[misc]
                pipe,
            )
            transports.append(transport)
            readers.append(reader)
        w_transport, w_protocol = await loop.connect_write_pipe(
            lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader(loop=loop), loop=loop),
            popen.stdin,
        )
        transports.append(w_transport)
    except BaseException:
        for t in transports:
            t.close()
        with contextlib.suppress(ProcessLookupError):
            popen.kill()
        popen.wait()
        raise
    writer = asyncio.StreamWriter(w_transport, w_protocol, None, loop)
    return Child(popen, writer, readers[0], readers[1], transports)
