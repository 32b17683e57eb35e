"""The dashboard's "Does carving help on this host?" panel in a real browser (Debian's Chromium):
the newest kept advice run's verdict, reason and caveat, and its HTML report behind the link.
Screenshots land in tests/output/ (advice-panel.png, advice-report.png)."""

from __future__ import annotations

import pytest
from pgcarve.advice.verdict import Runs, decide
from pgcarve_api.advice_runs import AdviceStore

from tests.browser.conftest import CHROMIUM, OUTPUT
from tests.unit.test_advice_report import recorded

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip("needs Debian's Chromium at /usr/bin/chromium (apt-get install -y chromium)",
                allow_module_level=True)

from playwright.sync_api import expect  # noqa: E402


def test_the_newest_advice_and_its_report(browser, live_api):
    page = browser.new_context(viewport={"width": 1366, "height": 900}).new_page()
    page.set_default_timeout(10_000)
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.goto(live_api.base_url + "/")
    expect(page.get_by_test_id("advice-empty")).to_be_visible()

    store = AdviceStore(live_api.service.paths.state_dir / "advice")
    older = {**recorded(), "finished_at": "2026-11-26T10:00:00+0000"}
    store.save("00000000000a", older)
    newer = {**recorded(), "finished_at": "2026-11-26T11:00:00+0000"}
    newer["verdict"] = decide({2: Runs((185.0, 190.0, 195.0))}, Runs((68.0, 70.0, 72.0)), emulated=True).to_dict()
    store.save("00000000000b", newer)
    page.reload()
    expect(page.get_by_test_id("advice-verdict")).to_have_text("inconclusive: the guests ran under emulation")
    expect(page.get_by_test_id("advice-caveat")).to_contain_text("QEMU TCG")
    expect(page.get_by_test_id("advice-when")).to_contain_text("host db1, finished 2026-11-26T11:00:00+0000")
    expect(page.get_by_test_id("advice-report")).to_have_attribute("href", "/v1/advice/00000000000b/report")
    OUTPUT.mkdir(parents=True, exist_ok=True)
    page.get_by_test_id("advice-panel").screenshot(path=str(OUTPUT / "advice-panel.png"))

    report = page.context.new_page()
    report.goto(live_api.base_url + "/v1/advice/00000000000a/report")
    expect(report.locator("#verdict")).to_have_text("carving helps, 8 guests, 2.7x")
    expect(report.locator("svg")).to_have_count(2)
    report.screenshot(path=str(OUTPUT / "advice-report.png"), full_page=True)
    assert problems == []
