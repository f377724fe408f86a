"""``make cluster``: a scale-out cluster on this machine until Ctrl-C (docs/deploy.md).

PostgreSQL 15 (a throwaway cluster holding the store), one ``prefect server start``, one
``ephemeral serve`` with ``EPHEMERAL_EXECUTOR=dispatch`` on ``--port`` (default 8000) and two
``ephemeral worker`` processes, hosts ``a`` and ``b``, each with its own state dir. Prints the
API URL, an API key with $100 of credit, and the environment to point the CLI at it. Ctrl-C
stops every process and deletes the cluster's directory.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import tempfile
import time
from pathlib import Path

from tests.cluster.harness import Cluster
from tests.fixtures_pg import PgCluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--limit", type=int, default=4, help="runs per worker at once")
    args = ap.parse_args()
    pg = PgCluster()
    reason = pg.unavailable()
    if reason:
        raise SystemExit(reason)
    root = Path(tempfile.mkdtemp(prefix="ephemeral-cluster-"))
    # Ctrl-C and SIGTERM both stop everything (SIGINT may arrive ignored, e.g. from a script)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    cluster = None
    try:
        pg.start()
        print(f"PostgreSQL 15 on 127.0.0.1:{pg.port}", flush=True)
        cluster = Cluster(root, pg.url(pg.create_database("ephemeral")))
        cluster.start()
        print(f"prefect server: {cluster.server.api_url}", flush=True)
        key = cluster.make_key("demo", 100_000_000)
        url = cluster.start_api(port=args.port)
        print(f"API (EPHEMERAL_EXECUTOR=dispatch): {url}", flush=True)
        for host in ("a", "b"):
            cluster.start_worker(host, limit=args.limit, pool=1)
            print(f"worker {host}: state dir {cluster.state_dir(host)}", flush=True)
        print(
            "\nready. Try:\n"
            f"  export EPHEMERAL_URL={url} EPHEMERAL_API_KEY={key}\n"
            "  ephemeral run --model replay/sandbox-proof --prompt \"$(python3 -c 'import json; "
            'print(json.load(open("recipes/cassettes/sandbox-proof.json"))["prompt"])\')"\n'
            f"logs: {root}/*.log   (Ctrl-C stops everything)",
            flush=True,
        )
        while True:
            for name, proc in list(cluster.procs.items()):
                if proc.poll() is not None:
                    raise SystemExit(f"{name} exited:\n{cluster.tail(name)}")
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nstopping", flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
