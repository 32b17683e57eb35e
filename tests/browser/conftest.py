"""Browser tests' fixtures: Debian's Chromium driven by Playwright, and a live pgcarve API (the real
app and ManagerService on libvirt's test driver, tests/support/live_api.py) with two instances and
throughput fed once a second. Screenshots go to tests/output/."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.live_api import LiveApi, serve_live_api

CHROMIUM = Path("/usr/bin/chromium")
STATIC = Path(__file__).resolve().parents[2] / "api" / "pgcarve_api" / "static"
OUTPUT = Path(__file__).resolve().parents[1] / "output"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's Chromium at /usr/bin/chromium (apt-get install -y chromium)")
    if not (STATIC / "vendor" / "uPlot.iife.min.js").exists():
        pytest.fail("static/vendor/ is not built: run api/pgcarve_api/static/build-vendor.sh (make vendor)")
    from playwright import sync_api

    # expect() waits 5 s by default, whatever the page's timeout; a first load of many rows on a
    # loaded 2-core machine can take longer. Each expect() still returns as soon as it holds.
    sync_api.expect.set_options(timeout=15_000)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def live_api(tmp_path: Path) -> Iterator[LiveApi]:
    # No guest image on purpose: a scale-up is accepted, then fails fast with ImageMissing.
    with serve_live_api(tmp_path / "state") as api:
        yield api
