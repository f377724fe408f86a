"""A no-op flow and a no-op task for ``bench/scaleout.py --mechanisms``: each appends the moment
its body starts to a file, so the bench measures dispatch latency alone (no sandbox)."""

from __future__ import annotations

import os
import time

from prefect import flow, task


def _mark(i: int) -> None:
    with open(os.environ["SCALEOUT_MARKS"], "a") as fh:
        fh.write(f"{i} {time.time()}\n")


@flow(name="scaleout-noop", persist_result=False)
def noop_flow(i: int) -> None:
    _mark(i)


@task(name="scaleout-noop-task")
def noop_task(i: int) -> None:
    _mark(i)
