"""The path of one run under ``ephemeral serve``: hops and files from ``POST /v1/runs`` to its
record, the event loops and threads it crosses, the runtimes, engines (slot semaphores) and run
handles it uses, and how many times its record is written. Prints numbers; asserts nothing.

    .venv/bin/python bench/hops.py [--executor flow] [--isolation namespaces]

The real app (``create_app`` with its own runtime, as ``serve`` starts it: embedded Prefect,
warm pool of 1) is driven in process through httpx's ASGI transport; a profiler hook follows
every call into the project's code (``ephemeral/``, ``flows/``, ``tasks/``) while one run of
the seed-shaped request executes.

hops   the project functions on the chain from the route handler to ``closing.record``:
       the stack at the record, then, for each asyncio task on it, the stack that created the
       task (across threads too: ``run_coroutine_threadsafe``), up to the handler. Prefect's
       frames in between are counted apart (``prefect frames``).
files  the distinct project files those hops are in.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dis
import gc
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.served import SEED_BODY, make_key  # noqa: E402
from ephemeral.settings import Settings  # noqa: E402

PROJECT = tuple(str(REPO / d) for d in ("ephemeral", "flows", "tasks"))
Frame = tuple[str, str]  # (file relative to the repo, qualified name)


def _project(filename: str) -> str | None:
    if not filename.startswith(PROJECT):
        return None
    return str(Path(filename).resolve().relative_to(REPO.resolve()))


def _stack(frame: FrameType | None) -> tuple[list[Frame], int]:
    """Project frames of ``frame``'s chain (innermost first) and the count of Prefect's."""
    out: list[Frame] = []
    prefect = 0
    while frame is not None:
        code = frame.f_code
        if code.co_qualname == "Handle._run":
            break  # the bottom of an asyncio task's step: below is the loop's own thread
        rel = _project(code.co_filename)
        if rel is not None:
            out.append((rel, code.co_qualname))
        elif "/prefect/" in code.co_filename:
            prefect += 1
        frame = frame.f_back
    return out, prefect


_RESUME: dict[CodeType, int] = {}


def _first_resume(code: CodeType) -> int:
    at = _RESUME.get(code)
    if at is None:
        at = next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), 0)
        _RESUME[code] = at
    return at


class Tracer:
    def __init__(self) -> None:
        self.on = False
        self.parents: dict[int, tuple[asyncio.Task[Any] | None, list[Frame], int]] = {}
        self.threadsafe: dict[int, tuple[asyncio.Task[Any] | None, list[Frame], int]] = {}
        self.chains: list[tuple[list[Frame], int]] = []
        self.calls: dict[str, int] = {}
        self.threads: set[str] = set()
        self.loops: set[int] = set()
        self.records: list[str] = []  # run ids, per record_run call
        self.marks: list[str] = []  # run ids, per store.runs.mark_recorded call

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.on:
            return
        rel = _project(frame.f_code.co_filename)
        if rel is None or frame.f_lasti > _first_resume(frame.f_code):
            return  # a coroutine resumed: not a call
        name = frame.f_code.co_qualname
        self.threads.add(threading.current_thread().name)
        with contextlib.suppress(RuntimeError):
            self.loops.add(id(asyncio.get_running_loop()))
        key = f"{rel}:{name}"
        self.calls[key] = self.calls.get(key, 0) + 1
        if key == "ephemeral/engine/record.py:record_run":
            self.records.append(frame.f_locals["row"].id)
        elif key == "ephemeral/store/runs.py:Runs.mark_recorded":
            self.marks.append(frame.f_locals["run_id"])
        if rel == "ephemeral/engine/close.py" and name == "record":
            self.chains.append(self._chain(frame))

    def _chain(self, frame: FrameType) -> tuple[list[Frame], int]:
        frames, prefect = _stack(frame)
        task = asyncio.current_task()
        seen: set[int] = set()
        while task is not None and id(task) not in seen:
            seen.add(id(task))
            parent, created, p = self.parents.get(id(task), (None, [], 0))
            frames += created
            prefect += p
            task = parent
        return frames, prefect


TRACER = Tracer()
_create_task = asyncio.BaseEventLoop.create_task
_threadsafe = asyncio.run_coroutine_threadsafe


def create_task(self: asyncio.BaseEventLoop, coro: Any, **kw: Any) -> asyncio.Task[Any]:
    task = _create_task(self, coro, **kw)
    if TRACER.on:
        try:
            parent = asyncio.current_task(self)
        except RuntimeError:
            parent = None
        frames, prefect = _stack(sys._getframe(1))
        if parent is None and id(coro) in TRACER.threadsafe:
            parent, more, p = TRACER.threadsafe[id(coro)]
            frames, prefect = frames + more, prefect + p
        TRACER.parents[id(task)] = (parent, frames, prefect)
    return task


def run_coroutine_threadsafe(coro: Any, loop: asyncio.AbstractEventLoop) -> Any:
    if TRACER.on:
        frames, prefect = _stack(sys._getframe(1))
        TRACER.threadsafe[id(coro)] = (asyncio.current_task(), frames, prefect)
    return _threadsafe(coro, loop)


async def one_run(executor: str, isolation: str) -> None:
    from ephemeral.flows.embedded_server import configure

    state = Path(tempfile.mkdtemp(prefix="ephemeral-bench-hops-"))
    settings = Settings.load(
        state_dir=state,
        executor=executor,
        isolation=isolation,
        pool_size=1,
        default_model="replay/sandbox-proof",
    )
    if executor != "plain":
        configure(settings)
    key = await make_key(settings)
    from ephemeral.api import create_app
    from ephemeral.engine.engine import Engine, EngineRunHandle
    from ephemeral.engine.runtime import Runtime

    handles = 0
    init = EngineRunHandle.__init__

    def counted(self: EngineRunHandle, *a: Any, **kw: Any) -> None:
        nonlocal handles
        handles += TRACER.on
        init(self, *a, **kw)

    EngineRunHandle.__init__ = counted  # type: ignore[method-assign]
    app = create_app(settings, warm_pool=True)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://t", headers={"Authorization": f"Bearer {key}"}
        ) as client:
            # one run first: imports, Prefect's client, the pool
            for traced in (False, True):
                TRACER.on = traced
                r = await client.post("/v1/runs", json={**SEED_BODY, "isolation": isolation})
                r.raise_for_status()
                run_id = r.json()["id"]
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    row = (await client.get(f"/v1/runs/{run_id}")).json()
                    if row.get("settled") or row.get("status") in ("succeeded", "failed"):
                        await asyncio.sleep(2.0)  # the record after the close
                        break
                    await asyncio.sleep(0.05)
                TRACER.on = False
            gc.unfreeze()  # serve froze its start-up heap: count those objects too
            runtimes = sum(isinstance(o, Runtime) for o in gc.get_objects())
            engines = sum(isinstance(o, Engine) for o in gc.get_objects())
    report(executor, runtimes, engines, handles, run_id)


def report(executor: str, runtimes: int, engines: int, handles: int, run_id: str) -> None:
    print(f"\none run under serve, EPHEMERAL_EXECUTOR={executor}")
    records = TRACER.records.count(run_id)
    marks = TRACER.marks.count(run_id)
    print(f"  record written      {records} (recorded marker set {marks})")
    print(f"  runtimes / engines  {runtimes} / {engines} (one slot semaphore per engine)")
    print(f"  RunHandles made     {handles}")
    print(f"  event loops         {len(TRACER.loops)} running project code")
    print(f"  threads             {sorted(TRACER.threads)}")
    print(f"  project functions   {len(TRACER.calls)} distinct called during the run")
    files = {k.split(":")[0] for k in TRACER.calls}
    print(f"  project files       {len(files)} touched during the run")
    if TRACER.chains:
        frames, prefect = TRACER.chains[0]
        hops = [f for i, f in enumerate(frames) if i == 0 or f != frames[i - 1]]
        print(f"  hops POST → record  {len(hops)} over {len({f for f, _ in hops})} files")
        print(f"  prefect frames      {prefect} on that chain")
        for rel, name in reversed(hops):
            print(f"    {rel}:{name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--executor", default="flow")
    ap.add_argument("--isolation", default="namespaces")
    args = ap.parse_args()
    asyncio.BaseEventLoop.create_task = create_task  # type: ignore[method-assign]
    asyncio.run_coroutine_threadsafe = run_coroutine_threadsafe
    threading.setprofile(TRACER.profile)
    sys.setprofile(TRACER.profile)
    try:
        asyncio.run(one_run(args.executor, args.isolation))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
