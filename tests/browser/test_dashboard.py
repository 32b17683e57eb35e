"""The live dashboard in a real browser (Debian's Chromium, driven by Playwright).

Against the real API and ManagerService on libvirt's test driver (see conftest.py): the chart
fills from history and the event stream and moves on, the headlines and the per-instance table
show what the service measures, and the scale control goes through the token prompt to the
API's 401, 409 and 202 answers. A screenshot lands in tests/output/dashboard.png.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest

from tests.browser.conftest import CHROMIUM, OUTPUT

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip("needs Debian's Chromium at /usr/bin/chromium (apt-get install -y chromium)",
                allow_module_level=True)

# Only now: without Chromium the module is skipped, but a missing playwright is an error.
from playwright.sync_api import expect  # noqa: E402


def chart_state(page):
    return page.evaluate(
        "() => window.pgcarveChart ? {n: pgcarveChart.data[0].length, min: pgcarveChart.scales.x.min,"
        " max: pgcarveChart.scales.x.max} : null"
    )


def test_dashboard_live(browser, live_api):
    context = browser.new_context(viewport={"width": 1366, "height": 768})
    page = context.new_page()
    page.set_default_timeout(10_000)
    requested: list[str] = []
    problems: list[str] = []
    page.on("request", lambda r: requested.append(r.url))
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)

    try:
        page.goto(live_api.base_url + "/")
        expect(page).to_have_title("pgcarve dashboard")

        # Live numbers: the chart has drawn >= 2 points and the headlines are human numbers.
        page.wait_for_function("() => window.pgcarveChart && pgcarveChart.data[0].length >= 2")
        expect(page.get_by_test_id("headline-tps")).to_have_text(re.compile(r"^\d+(\.\d)?[KMBT]? TPS$"))
        expect(page.get_by_test_id("headline-qps")).to_have_text(re.compile(r"^\d+(\.\d)?[KMBT]? QPS$"))
        # ~12.5K TPS fed in total: the headline says so in thousands.
        expect(page.get_by_test_id("headline-tps")).to_have_text(re.compile(r"K TPS$"))

        # One table row per instance, with placement from libvirt and rates from the stream.
        rows = page.get_by_test_id("instance-row")
        expect(rows).to_have_count(len(live_api.instances))
        expected_docs = {d["name"]: d for d in live_api.service.instance_docs()}
        for name in live_api.instances:
            row = page.locator(f'[data-testid="instance-row"][data-instance="{name}"]')
            expect(row.get_by_test_id("cell-name")).to_have_text(name)
            expect(row.get_by_test_id("cell-host")).to_have_text("h1")
            cpus = expected_docs[name]["vcpus"]
            assert len(cpus) == 2 and cpus[1] == cpus[0] + 1, cpus
            expect(row.get_by_test_id("cell-cpus")).to_have_text(f"{cpus[0]}-{cpus[1]}")
            expect(row.get_by_test_id("cell-state")).to_have_text("running")
            expect(row.get_by_test_id("cell-tps")).to_have_text(re.compile(r"^\d+(\.\d)?K$"))
            expect(row.get_by_test_id("cell-qps")).to_have_text(re.compile(r"^\d+(\.\d)?K$"))
            expect(row.get_by_test_id("cell-standbys")).to_have_text("none")
        expect(page.get_by_test_id("instance-count")).to_have_text(str(len(live_api.instances)))
        # This service runs without its HA loop: the incidents panel says so rather than "no incident".
        expect(page.get_by_test_id("incidents-empty")).to_have_text(re.compile(r"^The HA loop is off"))

        # The chart moves on: its x-range advances by the seconds that pass (the feeder adds a
        # point a second; 10 s is far more than the 2 s this needs).
        before = chart_state(page)
        page.wait_for_function(f"() => pgcarveChart.scales.x.max >= {before['max']} + 1.5", timeout=10_000)
        after = chart_state(page)
        assert after["n"] > before["n"], (before, after)
        assert after["max"] > before["max"], (before, after)

        scale_input = page.get_by_test_id("scale-input")
        scale_button = page.get_by_test_id("scale-button")
        dialog = page.get_by_test_id("token-dialog")
        message = page.get_by_test_id("scale-message")

        # A wrong token: the prompt asks for it, the API says 401, the page says "wrong token".
        scale_input.fill("3")
        scale_button.click()
        expect(dialog).to_be_visible()
        expect(page.get_by_label("Token", exact=True)).to_have_attribute("type", "password")
        page.get_by_test_id("token-input").fill("not-the-token")
        page.get_by_test_id("token-submit").click()
        expect(dialog).to_be_hidden()
        expect(message).to_have_text(re.compile(r"wrong token", re.IGNORECASE))
        assert page.evaluate("() => sessionStorage.getItem('pgcarve.apiToken')") is None

        # The right token, above capacity: the API's 409 detail is shown as it is.
        too_many = live_api.capacity + 5
        scale_input.fill(str(too_many))
        scale_button.click()
        expect(dialog).to_be_visible()
        page.get_by_test_id("token-input").fill(live_api.token)
        page.get_by_test_id("token-submit").click()
        expect(message).to_have_text(re.compile(
            rf"Cannot scale to {too_many}: .*room for {live_api.capacity} instances.*{too_many} requested"))
        expect(message).to_have_class(re.compile(r"\berror\b"))

        # A valid count: no prompt this time (the token is kept for the tab), 202, and the
        # operation shows up with a progress bar. The live API has no guest image, so the
        # scale-up fails; the page follows it to the end and shows why.
        target = len(live_api.instances) + 1
        scale_input.fill(str(target))
        scale_button.click()
        expect(dialog).to_be_hidden()
        expect(message).to_have_text(re.compile(rf"Accepted: scaling to {target}"))
        op = page.get_by_test_id("operation").first
        expect(op).to_be_visible()
        expect(op).to_contain_text(f"Scale to {target}")
        expect(op.get_by_test_id("operation-progress")).to_have_attribute("role", "progressbar")
        op_id = op.get_attribute("data-op-id")
        assert op_id and live_api.service.operations.get(op_id) is not None
        expect(op).to_have_attribute("data-status", "failed")
        final = live_api.service.operations.get(op_id)
        assert final is not None and final.status == "failed" and "no guest image" in (final.error or ""), final
        expect(op.get_by_test_id("operation-error")).to_have_text(final.error or "")

        # The token stays out of the page's source and URL; sessionStorage holds it.
        assert page.evaluate("() => sessionStorage.getItem('pgcarve.apiToken')") == live_api.token
        assert live_api.token not in page.url
        assert live_api.token not in page.evaluate("() => document.documentElement.outerHTML")

        OUTPUT.mkdir(parents=True, exist_ok=True)
        # Checked in an animation frame: what the checks above saw has been laid out and painted.
        page.wait_for_function("() => document.readyState === 'complete'", polling="raf")
        page.screenshot(path=str(OUTPUT / "dashboard.png"), full_page=True)
    finally:
        context.close()

    # Nothing left the machine: only this server was asked for anything.
    origin = urlsplit(live_api.base_url)
    outside = [u for u in requested
               if not u.startswith("data:") and urlsplit(u)[:2] != (origin.scheme, origin.netloc)]
    assert not outside, outside
    paths = {urlsplit(u).path for u in requested if not u.startswith("data:")}
    assert {"/", "/static/dashboard.js", "/static/vendor/uPlot.iife.min.js", "/v1/events"} <= paths, paths
    # The 401 and 409 answers are logged by Chromium as failed resources; anything else is a bug.
    unexpected = [p for p in problems if "status of 401" not in p and "status of 409" not in p]
    assert not unexpected, unexpected


def test_formatting_and_standbys(browser, live_api):
    """Human numbers, and the standby columns (this test host has none: /v1/instances is stubbed
    with the documented shape; everything else is the live API)."""
    docs = live_api.service.instance_docs()
    docs[0]["standbys"] = [
        {"name": "pgc-01-s1", "host": "h2", "state": "streaming", "sync_state": "sync", "replay_lag_bytes": 1536},
        {"name": "pgc-01-s2", "host": "h3", "state": "streaming", "sync_state": "potential",
         "replay_lag_bytes": 5 * 1024 * 1024},
    ]
    docs[1]["standbys"] = [
        {"name": "pgc-02-s1", "host": "h3", "state": "not streaming", "sync_state": None, "replay_lag_bytes": None},
    ]
    retired_words = ("none: retired since 2026-11-24 03:10 UTC; its disks are kept (5120 MiB): scaling up brings it "
                     "back, `pgcarve purge pgc-07` deletes it")
    docs.append({"name": "pgc-07", "host": "h1", "state": "retired", "writes": retired_words, "incident": None,
                 "vcpus": [], "memory_mib": 0, "dsn": None, "retired_at": 1795489800.0, "disk_mib": 5120,
                 "standbys": [{"name": "pgc-07-s1", "host": "h2", "state": "retired", "sync_state": None,
                               "replay_lag_bytes": None}]})
    context = browser.new_context(viewport={"width": 1366, "height": 768})
    page = context.new_page()
    page.set_default_timeout(10_000)
    try:
        page.route("**/v1/instances?include=retired", lambda route: route.fulfill(json=docs))
        page.goto(live_api.base_url + "/")
        page.wait_for_function("() => window.pgcarveDashboard")
        formatted = page.evaluate("""() => {
            const d = window.pgcarveDashboard;
            return [d.human(0), d.human(4.56), d.human(999), d.human(12345), d.human(99960), d.human(1234567),
                    d.human(2.5e9), d.human(null), d.humanBytes(0), d.humanBytes(512), d.humanBytes(1536),
                    d.humanBytes(5 * 1048576), d.humanBytes(3 * 2 ** 30), d.humanBytes(null),
                    d.cpuset([8, 0, 1, 2, 3]), d.cpuset([5])];
        }""")
        assert formatted == ["0", "4.6", "999", "12.3K", "100K", "1.2M", "2.5B", "—", "0 B", "512 B", "1.5 KiB",
                             "5.0 MiB", "3.0 GiB", "—", "0-3,8", "5"]

        first = page.locator('[data-testid="instance-row"][data-instance="pgc-01"]')
        standbys = first.get_by_test_id("standby")
        expect(standbys).to_have_count(2)
        expect(standbys.nth(0)).to_contain_text("pgc-01-s1")
        expect(standbys.nth(0)).to_contain_text("streaming")
        expect(standbys.nth(0)).to_contain_text("sync")
        expect(standbys.nth(0)).to_contain_text("lag 1.5 KiB")
        expect(standbys.nth(1)).to_contain_text("potential")
        expect(standbys.nth(1)).to_contain_text("lag 5.0 MiB")
        # The instance's replay lag: the stream has none for it (no collector), so the worst standby's.
        expect(first.get_by_test_id("cell-lag")).to_have_text("5.0 MiB")
        second = page.locator('[data-testid="instance-row"][data-instance="pgc-02"]')
        expect(second.get_by_test_id("standby")).to_contain_text("not streaming")
        expect(second.get_by_test_id("standby")).to_contain_text("lag —")
        expect(second.get_by_test_id("cell-tps")).to_have_text(re.compile(r"^\d+(\.\d)?K$"))
        # A retired instance is listed, says what it keeps and how to bring it back, and counts for nothing.
        retired = page.locator('[data-testid="instance-row"][data-instance="pgc-07"]')
        expect(retired).to_contain_text("retired")
        expect(retired.locator(".badge.retired").first).to_have_attribute("title", retired_words)
        expect(retired.get_by_test_id("standby")).to_contain_text("pgc-07-s1")
        expect(page.get_by_test_id("instance-count")).to_have_text(str(len(docs) - 1))
        OUTPUT.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(OUTPUT / "dashboard-standbys.png"), full_page=True)
    finally:
        context.close()
