"""The pages in real headless Chromium: playground → live run page → settled; sample replay."""

from __future__ import annotations

import datetime
import json
from typing import Any

import httpx
import pytest

from ephemeral.settings import Settings
from tests.api.server import LiveServer, live_server
from tests.browser.conftest import shot

pytestmark = [pytest.mark.browser, pytest.mark.sandbox]

# The product page's request.json, byte for byte in meaning.
PRODUCT_REQUEST = {
    "prompt": "This is a sandbox test. Do these steps with the shell and report the real output, "
    "never what you expect. 1) Write a small script that prints the first 15 prime numbers, run "
    "it and show the output. 2) Run `whoami` and `pwd`. 3) Try to reach the internet with "
    "`curl -sS -m 8 https://example.com` (and, if curl is missing, python3 with urllib) and "
    "report the exact error. 4) Write a file named /tmp/proof.txt and list it. Reply in Markdown, "
    "at most 120 words: one line per step with the result, then one sentence saying whether the "
    "network call succeeded.",
    "web": False,
    "shell": True,
    "timeout_seconds": 120,
    "max_cost_micros": 40000,
}


def test_playground_starts_a_run_and_the_page_follows_it_to_settled(
    tab: Any, server: LiveServer
) -> None:
    key = server.member("browser")
    tab.goto(f"{server.url}/playground")
    tab.fill("input[name=api_key]", key)
    tab.fill("textarea[name=prompt]", "Echo, wait two seconds, echo again.")
    tab.fill("input[name=timeout]", "60")
    tab.fill("input[name=budget]", "0.02")
    tab.fill("input[name=model]", "replay/api-live")  # a cassette that sleeps two seconds
    tab.click("#start")
    tab.wait_for_url(f"{server.url}/runs/run_*")
    shot(tab, "run-page-live")
    tab.wait_for_selector('li[data-type="run.settled"]', timeout=60_000)
    tab.wait_for_function("document.getElementById('live-state').textContent === 'Settled.'")
    shot(tab, "run-page-settled")
    types = tab.eval_on_selector_all("#timeline > li", "els => els.map(e => e.dataset.type)")
    assert types[0] == "run.queued" and types[-1] == "run.settled"
    assert "shell.executed" in types and "sandbox.destroyed" in types
    assert len(types) == len(
        set(tab.eval_on_selector_all("#timeline > li", "els => els.map(e => e.dataset.seq)"))
    )  # no row twice
    text = tab.inner_text("#run")
    assert "$ echo starting" in text and "still here" in text
    assert "Finished" in tab.inner_text(".markdown strong")
    assert "Worker disposed:" in tab.inner_text("#summary")
    assert tab.get_attribute("#summary", "data-status") == "succeeded"


def test_sample_replays_step_by_step_and_opens_the_playground(tab: Any, server: LiveServer) -> None:
    # The page's clock is paused and advanced by hand: at 20x the 1.4 s recording plays in 70 ms,
    # less than two clicks can take on a loaded box.
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    tab.clock.install(time=t0)
    tab.goto(f"{server.url}/samples/sandbox-proof")
    tab.clock.pause_at(t0 + datetime.timedelta(hours=1))
    total = tab.eval_on_selector_all("#timeline > li", "els => els.length")
    assert tab.eval_on_selector_all("#timeline > li.hidden", "els => els.length") == total
    tab.select_option("#speed", "20")
    tab.click("#play")
    assert tab.get_attribute("#play", "data-state") == "playing"
    assert tab.get_attribute("#timeline", "data-done") == "0"
    tab.clock.run_for(200)  # 4 s of the recording at 20x
    tab.wait_for_selector('#timeline[data-done="1"]', timeout=30_000)
    assert tab.get_attribute("#play", "data-state") == "paused"
    assert tab.inner_text("#play") == "Replay"
    assert tab.eval_on_selector_all("#timeline > li.hidden", "els => els.length") == 0
    assert tab.inner_text("#progress") == f"{total} of {total} steps"
    text = tab.inner_text("#timeline")
    assert "$ pwd; whoami" in text and "Could not resolve host" in text
    shot(tab, "sample-replayed")
    tab.click("#restart")  # rewinds and plays from the first step
    assert tab.get_attribute("#play", "data-state") == "playing"
    tab.click("#play")  # and pauses where it is: no time has passed
    assert tab.get_attribute("#play", "data-state") == "paused"
    shown = total - tab.eval_on_selector_all("#timeline > li.hidden", "els => els.length")
    assert 0 <= shown < total
    assert tab.inner_text("#progress") == f"{shown} of {total} steps"
    tab.click("#run-yourself")
    tab.wait_for_url(f"{server.url}/playground?sample=sandbox-proof")
    assert tab.input_value("textarea[name=prompt]").startswith("This is a sandbox test.")
    assert tab.input_value("input[name=budget]") == "0.04"
    shot(tab, "playground-prefilled")


def test_product_page_curl_run_shows_its_full_timeline(tab: Any, api_settings: Settings) -> None:
    """Done means: the product page's exact request (server default model
    replay/sandbox-proof) succeeds with the sample's shell steps, and its page shows them."""
    settings = api_settings.model_copy(update={"default_model": "replay/sandbox-proof"})
    with live_server(settings) as srv:
        key = srv.member("acme")
        body = json.dumps(PRODUCT_REQUEST)
        r = httpx.post(
            f"{srv.url}/v1/runs",
            content=body,
            headers={
                "Authorization": f"Bearer {key}",
                "Content-Type": "application/json",
                "Idempotency-Key": "3f1c2b8e-uuidgen",
            },
        )
        assert r.status_code == 201, r.text
        run = r.json()
        tab.goto(f"{srv.url}/login?next=/runs/{run['id']}")
        tab.fill("input[name=api_key]", key)
        tab.click("#sign-in")
        tab.wait_for_url(f"{srv.url}/runs/{run['id']}")
        tab.wait_for_selector('li[data-type="run.settled"]', timeout=90_000)
        shot(tab, "product-page-run")
        commands = tab.eval_on_selector_all(
            'li[data-type="shell.executed"] code.cmd', "els => els.map(e => e.textContent)"
        )
        assert len(commands) == 4
        assert commands[0].startswith("$ pwd; whoami")
        assert "curl -sS -m 8 https://example.com" in commands[1]
        assert "primes" in commands[2]
        assert "/tmp/proof.txt" in commands[3]
        assert "Could not resolve host" in tab.inner_text("#timeline")
        assert tab.get_attribute("#summary", "data-status") == "succeeded"
        final = httpx.get(
            f"{srv.url}/v1/runs/{run['id']}", headers={"Authorization": f"Bearer {key}"}
        ).json()
        assert final["status"] == "succeeded" and final["model"] == "replay/sandbox-proof"
