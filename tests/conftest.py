"""Test harness root: one Prefect home per session, real state dirs per test.

Prefect reads its settings from the environment once, so the session's Prefect home is set in
``pytest_configure``, before any test module imports Prefect. Images and the pre-migrated
Prefect template live in the shared cache dir (``~/.cache/ephemeral``), built by ``make setup``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from ephemeral.settings import Settings

pytest_plugins = ["tests.fixtures_pg"]

REPO = Path(__file__).resolve().parent.parent
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="ephemeral-tests-"))


def pytest_configure(config: pytest.Config) -> None:
    from ephemeral import prefect_setup
    from tests import drivers

    drivers.required()  # a typo in EPHEMERAL_TEST_REQUIRE_DRIVERS stops the run here

    os.environ["PREFECT_HOME"] = str(_SESSION_TMP / "prefect")
    # Prefect reads this once, at import: its embedded server's start took more than the
    # default 90 s at load 40 on these 2 cores. A bound against a server that never comes up.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "900")
    prefect_setup.configure(Settings.load(state_dir=_SESSION_TMP / "state"))


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


# The TCG microVM variants kept in `make test` (the microVM driver's own tests in
# tests/sandbox/test_microvm.py stay too): the sandbox contract and web egress through the VM's
# channel. Every other `[microvm-tcg]` variant is `tcg_slow`, run by `make test-slow`: each costs
# minutes of software emulation, and on a loaded 2-core box no timeout holds them reliably.
TCG_SMOKE = ("tests/sandbox/test_conformance.py", "tests/egress/test_web.py")
# ...but not the conformance checks on the busybox image: it is registered under a name of the
# test process, so each session cold-boots it once more. tests/oci/test_microvm_boot.py keeps
# microVMs of images without Python in `make test` (their snapshots outlive the session).
TCG_SLOW_IN_SMOKE = "[microvm-tcg-busybox]"
# The files that take minutes, longest first (per-file sums of `--durations` on this 2-core box):
# the greedy longest-first schedule, so that no long file starts last and becomes the suite's
# tail while the other worker idles. Every other file follows: first those with a test marked
# slow, prefect or browser (so that an unmeasured file of one long test does not come last),
# then the rest; within each, the files with more tests first.
# `make test` passes `--no-loadscope-reorder`: else pytest-xdist (>= 3.5) orders files by test
# count itself, and a one-test file that takes minutes (the soak) started last.
LONG_FIRST = (
    "tests/test_stop_cleans_up.py",  # eight cold embedded Prefect servers
    "tests/cluster/test_scaleout.py",
    "tests/harbor/test_harbor.py",
    "tests/evals/test_eval_cli.py",
    "tests/gateway/test_agent_runs.py",  # builds the mini-swe-agent image when its hash is new
    "tests/harbor/test_registry_images.py",
    "tests/cluster/test_drain_admission.py",
    "tests/cluster/test_inspect_on_cluster.py",
    "tests/sessions/test_cli.py",
    "tests/evals/test_deploy.py",
    "tests/inspect/test_self_check.py",
    "tests/harbor/test_interrupts.py",
    "tests/cluster/test_sessions_placed.py",
    "tests/harbor/test_hostile_files.py",
    "tests/load/test_soak.py",
    "tests/evals/test_eval_knobs.py",
    "tests/evals/test_flows_prefect.py",
    "tests/sessions/test_sessions.py",
    "tests/harbor/test_prebuild.py",
    "tests/evals/test_multihost.py",
    "tests/harbor/test_environment.py",
    "tests/sessions/test_dockerfile_sessions.py",
    "tests/gateway/test_fields.py",
    "tests/inspect/test_example.py",
    "tests/sessions/test_egress.py",
    "tests/evals/test_coding_suite.py",
    "tests/api/test_prefect_path.py",
)

HEAVY_MARKERS = ("slow", "prefect", "browser")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.patience import HUNG_DIRS, HUNG_SECONDS

    for item in items:
        heavy = item.nodeid.startswith(HUNG_DIRS) or item.get_closest_marker("prefect")
        if heavy and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(HUNG_SECONDS))
        if "[microvm-tcg" in item.nodeid and (
            not item.nodeid.startswith(TCG_SMOKE) or item.nodeid.endswith(TCG_SLOW_IN_SMOKE)
        ):
            item.add_marker(pytest.mark.tcg_slow)

    def path(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    tests_in = Counter(path(item) for item in items)
    marked = {path(i) for i in items if any(i.get_closest_marker(m) for m in HEAVY_MARKERS)}

    def rank(item: pytest.Item) -> tuple[int, int, int]:
        p = path(item)
        if p in LONG_FIRST:
            return (LONG_FIRST.index(p), 0, 0)
        return (len(LONG_FIRST), p not in marked, -tests_in[p])

    items.sort(key=rank)  # stable: a file's tests stay together and in order


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """Settings on a fresh state dir; Prefect off (the Prefect path has its own tests)."""
    return Settings.load(state_dir=tmp_path / "state", use_prefect=False)


@pytest.fixture
def cassettes(tmp_path: Path) -> Iterator[Path]:
    """A cassette dir holding the shipped cassettes, where a test can add its own."""
    d = tmp_path / "cassettes"
    shutil.copytree(REPO / "recipes" / "cassettes", d)
    yield d
