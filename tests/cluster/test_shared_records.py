"""Records from every host under one shared root (EPHEMERAL_RECORDS_DIR; docs/deploy.md).

Two hosts write their own ``host=`` partitions; both run ``ephemeral records compact`` at the
same moment (as two hosts' timers would); a third host's ``query`` and ``costs`` then see every
run of both, each exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ephemeral.records import Records
from ephemeral.records.writer import write_run
from tests.patience import PATIENCE
from tests.records.helpers import make_run

REPO = Path(__file__).resolve().parents[2]


def _env(root: Path, host: str, tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "EPHEMERAL_RECORDS_DIR": str(root),
        "EPHEMERAL_HOST_ID": host,
        "EPHEMERAL_STATE_DIR": str(tmp / f"state-{host}"),
    }


def test_two_hosts_compact_at_once_and_any_host_sees_all(tmp_path: Path) -> None:
    root = tmp_path / "shared-records"
    per_host = 40
    for host in ("a", "b"):
        for i in range(per_host):
            write_run(root, *make_run(days_ago=2 + i % 3, host=host, content=f"{host}{i}"))
    cmd = [sys.executable, "-m", "ephemeral.cli", "records", "compact", "--older-than-days", "1"]
    procs = [
        subprocess.Popen(
            cmd, cwd=REPO, env=_env(root, h, tmp_path), stdout=subprocess.PIPE, text=True
        )
        for h in ("a", "b")
    ]
    outs = [p.communicate(timeout=PATIENCE)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    # each host's partitions were compacted once, by whichever host took its lock first
    merged = sum(int(o.split()[1]) for o in outs)
    assert merged == 3 * 2 * per_host  # runs, steps and events files of 80 runs
    assert not list(root.rglob("run_*.parquet"))

    _, rows = Records(root).query(
        "SELECT host, count(*), count(DISTINCT run_id) FROM runs GROUP BY host ORDER BY host"
    )
    assert rows == [("a", per_host, per_host), ("b", per_host, per_host)]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ephemeral.cli",
            "costs",
            "--by",
            "status",
            "--since",
            "30d",
            "--format",
            "json",
        ],
        cwd=REPO,
        env=_env(root, "c", tmp_path),
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    [costs] = json.loads(res.stdout)
    assert costs["runs"] == 2 * per_host
    assert costs["charged_micros"] == 2 * per_host * 3530
