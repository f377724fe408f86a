"""The results viewer in headless Chromium (issue 37): the runs list with its filters and paging,
a suite run's page and the compare page, over two real suite runs in real sandboxes."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ephemeral.api import viewer
from ephemeral.engine.runtime import LOCAL_ORG
from ephemeral.evals.plan import Evaluation
from ephemeral.evals.store import write_report
from ephemeral.evals.suite import run_evaluation
from ephemeral.recipes.recipe import load_recipe
from ephemeral.settings import Settings
from ephemeral.store import Store
from tests import runlevel
from tests.api.server import live_server
from tests.browser.conftest import shot
from tests.recipes.helpers import write

pytestmark = [pytest.mark.browser, pytest.mark.sandbox]


def _recipe(root: Path, name: str, wanted: str) -> Any:
    return load_recipe(
        write(
            root,
            f"""
        name: {name}
        model: replay/api-quick
        prompt: "go"
        verify: ["echo graded; test {wanted} = Done"]
        policy: {{isolation: namespaces, timeout_seconds: 60, max_cost_micros: 20000}}
        checks:
          - output_contains: "{wanted}"
          - verify: {{exit_code: 0}}
    """,
            name=f"{name}-{wanted}.yaml",
        )
    )


async def _two_suite_runs(settings: Settings, root: Path) -> tuple[str, str, str]:
    """A suite run where both recipes pass, then one where `changes` fails; and a member key
    of the local org (whose runs these are)."""
    ids = []
    async with runlevel.started(settings) as runtime:
        for wanted in ("Done", "Nope"):
            report = await run_evaluation(
                runtime,
                Evaluation(
                    name="viewer",
                    recipes=[_recipe(root, "stable", "Done"), _recipe(root, "changes", wanted)],
                    concurrency=1,
                ),
            )
            write_report(report, settings)
            ids.append(report.suite_run_id)
    store = await Store.open(settings.db_url)
    try:
        org = await store.orgs.ensure(LOCAL_ORG)
        _, key = await store.keys.create(org.id, "me@local.test")
    finally:
        await store.close()
    return ids[0], ids[1], key


def test_runs_list_suite_page_and_compare(
    tab: Any, api_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Playwright's sync API holds this thread's event loop: the suites run on another thread.
    with ThreadPoolExecutor(1) as pool:
        first, second, key = pool.submit(
            asyncio.run, _two_suite_runs(api_settings, tmp_path / "recipes")
        ).result()
    monkeypatch.setattr(viewer, "PAGE_SIZE", 3)  # four runs: two pages
    with live_server(api_settings) as server:
        tab.goto(f"{server.url}/login?next=/runs")
        tab.fill("input[name=api_key]", key)
        tab.click("button[type=submit]")
        tab.wait_for_url(f"{server.url}/runs")
        shot(tab, "viewer-runs")
        assert len(tab.query_selector_all("#runs tbody tr")) == 3
        tab.click("#next")
        assert len(tab.query_selector_all("#runs tbody tr")) == 1
        assert tab.query_selector("#prev") is not None

        # Filters: a recipe, a suite run, an outcome's status; a bad date is refused.
        tab.goto(f"{server.url}/runs")
        tab.fill("#filters input[name=recipe]", "changes")
        tab.click("#filters button[type=submit]")
        outcomes = tab.eval_on_selector_all(
            "#runs tbody tr", "els => els.map(e => e.dataset.outcome)"
        )
        assert sorted(outcomes) == ["fail", "pass"]
        tab.goto(f"{server.url}/runs?suite={second}")
        assert len(tab.query_selector_all("#runs tbody tr")) == 2
        tab.goto(f"{server.url}/runs?status=cancelled")
        assert "No recorded runs match." in tab.inner_text("#runs")
        assert tab.goto(f"{server.url}/runs?date=yesterday").status == 422

        # The second suite run: its gate failed, the failure first with its verify output.
        tab.goto(f"{server.url}/runs?suite={second}")
        tab.click(f"#runs a[href='/suites/{second}']")
        tab.wait_for_url(f"{server.url}/suites/{second}")
        shot(tab, "viewer-suite")
        assert tab.get_attribute("#gate", "data-passed") == "false"
        assert "changes: pass rate 0% (0/1 graded)" in tab.inner_text("#gate-failures")
        table = tab.inner_text("#pass-table")
        assert "stable" in table and "changes" in table
        [failure] = tab.query_selector_all("#failures > li")
        assert failure.get_attribute("data-outcome") == "fail"
        text = failure.inner_text()
        assert "FAIL output_contains: Nope" in text and "exit 1" in text and "graded" in text
        assert tab.inner_text("#outcomes") == "0 error · 1 fail · 0 budget · 0 cancelled · 1 pass"
        assert tab.inner_text("#cost-split tbody td").startswith("$")
        failure.query_selector("a").click()
        tab.wait_for_url(f"{server.url}/runs/run_*")

        # Compare: the verdict that changed, and the cost and time deltas.
        tab.goto(f"{server.url}/suites/{first}/compare/{second}")
        shot(tab, "viewer-compare")
        assert "2 paired runs (0 new, 0 missing)" in tab.inner_text("#pairs")
        changed = tab.inner_text("#changed")
        assert "changes/{}/0: pass → fail" in changed
        assert tab.inner_text("#cost-delta").startswith("charged")
        assert tab.inner_text("#time-delta").startswith("run time")

        # Another org sees none of it.
        other = server.member("elsewhere")
        tab.goto(f"{server.url}/logout")
        tab.context.clear_cookies()
        tab.goto(f"{server.url}/login?next=/suites/{second}")
        tab.fill("input[name=api_key]", other)
        tab.click("button[type=submit]")
        assert "no recorded runs" in tab.inner_text("main")
