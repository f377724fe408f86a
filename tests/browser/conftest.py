"""Headless Chromium (Debian's, never a downloaded browser) against a real uvicorn on loopback."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from ephemeral.settings import Settings
from tests.api.conftest import api_settings  # noqa: F401 (a fixture the tests use)
from tests.api.server import LiveServer, live_server

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def chromium() -> Iterator[object]:
    if not Path(CHROMIUM).exists() or shutil.which(CHROMIUM) is None:
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def tab(chromium: object) -> Iterator[object]:
    context = chromium.new_context(viewport={"width": 1200, "height": 900})  # type: ignore[attr-defined]
    pg = context.new_page()
    try:
        yield pg
    finally:
        context.close()


@pytest.fixture
def server(api_settings: Settings) -> Iterator[LiveServer]:  # noqa: F811
    with live_server(api_settings) as srv:
        yield srv


def shot(page: object, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
    return path
