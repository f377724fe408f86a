"""What a batch of web charges costs the store: ``store.money.charge_batch`` with 1, 8, 32 and 128
charges (an egress stream charges one per MiB moved) on a real SQLite file, CPU of this
process per batch and per charge, beside one ``store.events.append`` (the store's cheapest write) in
the same process. Prints figures; asserts nothing.

    .venv/bin/python bench/ledger.py [--batches 200]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from ephemeral.engine.runtime import Runtime
from ephemeral.policy import RunRequest
from ephemeral.settings import Settings


def cpu() -> float:
    return time.process_time()  # every thread: aiosqlite runs the statements on its own


async def main(batches: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings.load(state_dir=Path(tmp) / "state", use_prefect=False)
        runtime = await Runtime.start(settings)
        try:
            org = await runtime.local_org()
            store = runtime.store
            request = RunRequest(
                prompt="bench", model="replay/sandbox-proof", max_cost_micros=10_000_000
            )
            row, _ = await runtime.admit(org, request)
            runtime.taken = {row.id}  # nothing executes it: not an orphan for the watchdog
            t = cpu()
            for i in range(batches):
                await store.events.append(row.id, "web.requested", {"method": "GET", "n": i})
            floor = (cpu() - t) / batches * 1e3
            print(f"events.append (floor)   {floor:6.3f} ms CPU")
            seq = 0
            for size in (1, 8, 32, 128):
                t = cpu()
                for _ in range(batches):
                    charges = []
                    for _ in range(size):
                        seq += 1
                        charges.append((f"{row.id}:egress:1:{seq}", 1))
                    await store.money.charge_batch(row.id, "web", charges)
                per_batch = (cpu() - t) / batches * 1e3
                print(
                    f"charge_batch of {size:<4}   {per_batch:6.3f} ms CPU a batch, "
                    f"{per_batch / size:6.3f} a charge ({per_batch / floor:5.2f}x the floor)"
                )
        finally:
            await runtime.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=200)
    asyncio.run(main(parser.parse_args().batches))
