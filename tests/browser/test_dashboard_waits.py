"""The dashboard's "what commits wait on" panel in a real browser (Debian's Chromium): the
selected instance's breakdown as a stacked bar with a legend, following the instance picker.

The live API runs on libvirt's test driver, where no PostgreSQL answers, so the service's wait
sampler is replaced by fixed breakdowns (control/waits.py's own arithmetic over fixed samples).
"""

from __future__ import annotations

import pytest
from pgcarve.control.waits import WaitBreakdown, breakdown_of

from tests.browser.conftest import CHROMIUM

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip("needs Debian's Chromium at /usr/bin/chromium (apt-get install -y chromium)",
                allow_module_level=True)

from playwright.sync_api import expect  # noqa: E402

SAMPLES = {
    "pgc-01": [{"SyncRep": 7, "client": 2, "CPU": 1}] * 20,
    "pgc-02": [{"WAL write": 1, "client": 3}] * 20,
}


class FixedWaits:
    """Stands in for WaitSampler: the same breakdowns every time."""

    window_s = 30.0

    def breakdown(self, instance: str) -> WaitBreakdown | None:
        samples = SAMPLES.get(instance)
        return breakdown_of(instance, samples, self.window_s) if samples else None


def test_waits_panel_follows_the_selected_instance(browser, live_api):
    live_api.service.waits = FixedWaits()
    page = browser.new_context(viewport={"width": 1366, "height": 900}).new_page()
    page.set_default_timeout(10_000)
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.goto(live_api.base_url + "/")
    legend = page.get_by_test_id("waits-legend").locator("li")
    expect(page.get_by_test_id("waits-instance")).to_have_value("pgc-01")
    expect(legend).to_have_text(["SyncRep 70%", "client 20%", "CPU 10%"])
    expect(page.get_by_test_id("waits-bar").locator("span")).to_have_count(3)
    expect(page.get_by_test_id("waits-summary")).to_contain_text("70% of sampled client-session time: SyncRep")
    page.get_by_test_id("waits-instance").select_option("pgc-02")
    expect(legend).to_have_text(["client 75%", "WAL write 25%"])
    assert problems == []
