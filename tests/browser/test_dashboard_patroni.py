"""The dashboard under `replication.roles: patroni`, in Debian's Chromium: each instance's state
cell shows Patroni's timeline when it has a leader and a synchronous standby, and what is wrong
when it does not, with every member in the badge's title. Patroni's keys are a real Patroni 4.0's
(tests/support/patroni_recorded.py) on the live API of libvirt's test driver; pgc-02's leader key
is taken away, as when its leader's lease ran out and no member could take it.
Screenshot: tests/output/dashboard-patroni.png.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from pgcarve.control.service import ManagerService

from tests.browser.conftest import CHROMIUM, OUTPUT
from tests.support.live_api import LiveApi, serve_live_api
from tests.support.patroni_recorded import INSTANCES, recorded_patroni

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip("needs Debian's Chromium at /usr/bin/chromium (apt-get install -y chromium)",
                allow_module_level=True)

from playwright.sync_api import Browser, expect  # noqa: E402

ROW = '[data-testid="instance-row"][data-instance="{}"]'


@pytest.fixture
def patroni_api(tmp_path: Path) -> Iterator[LiveApi]:
    def install(service: ManagerService) -> None:
        recorded = recorded_patroni(INSTANCES)
        recorded.views["pgc-02"] = replace(recorded.views["pgc-02"], leader=None)
        service.fleet.patroni = recorded  # type: ignore[assignment]

    with serve_live_api(tmp_path / "state", len(INSTANCES), prepare=install) as api:
        yield api


def test_leader_timeline_and_a_lost_leader(browser: Browser, patroni_api: LiveApi) -> None:
    docs = {d["name"]: d for d in httpx.get(patroni_api.base_url + "/v1/instances", timeout=10).json()}
    assert docs["pgc-01"]["patroni"]["leader"] == "pgc-01", docs["pgc-01"]
    assert docs["pgc-01"]["patroni"]["synchronous"] == ["pgc-01-s1"]
    assert docs["pgc-01"]["patroni"]["problem"] is None
    assert docs["pgc-02"]["patroni"]["leader"] is None
    assert docs["pgc-02"]["patroni"]["problem"].startswith("no leader"), docs["pgc-02"]

    page = browser.new_page(viewport={"width": 1366, "height": 900})
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    try:
        page.goto(patroni_api.base_url + "/")
        healthy = page.locator(ROW.format("pgc-01")).get_by_test_id("patroni")
        expect(healthy).to_have_text("timeline 1")
        expect(healthy).to_have_class("badge ok")
        title = healthy.get_attribute("title") or ""
        assert "leader pgc-01, synchronous pgc-01-s1 (on)" in title, title
        assert "pgc-01-s1: replica, running, timeline 1" in title, title
        lost = page.locator(ROW.format("pgc-02")).get_by_test_id("patroni")
        expect(lost).to_have_text("no leader")
        expect(lost).to_have_class("badge bad")
        assert (lost.get_attribute("title") or "").startswith("no leader: nobody holds the leader key")
        # The filter box finds instances by Patroni's problem too.
        page.get_by_test_id("instance-filter").fill("no leader")
        expect(page.locator('[data-testid="instance-row"]:visible')).to_have_count(1)
        expect(page.locator(ROW.format("pgc-02"))).to_be_visible()
        page.get_by_test_id("instance-filter").fill("")
        expect(page.locator('[data-testid="instance-row"]:visible')).to_have_count(len(INSTANCES))
        OUTPUT.mkdir(exist_ok=True)
        page.screenshot(path=str(OUTPUT / "dashboard-patroni.png"), full_page=True)
    finally:
        page.close()
    assert problems == []
