"""The dashboard's per-instance switchover, in Debian's Chromium.

The live API (conftest.py) runs on libvirt's test driver: no standbys and no PostgreSQL, so every
instance's button is disabled there and says why. The confirmed click is checked with
/v1/instances stubbed to the documented shape (standbys streaming): first against the real API,
which refuses it in its own words, then with Playwright intercepting the switchover request (202)
and serving a scripted operation document, which the page follows to its outcome.
Screenshots land in tests/output/dashboard-switchover*.png.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from tests.browser.conftest import CHROMIUM, OUTPUT

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip("needs Debian's Chromium at /usr/bin/chromium (apt-get install -y chromium)",
                allow_module_level=True)

from playwright.sync_api import Browser, Page, Request, Route, expect  # noqa: E402

from tests.support.live_api import LiveApi  # noqa: E402

ROW = '[data-testid="instance-row"][data-instance="{}"]'
OP_ID = "5w1tc40ver01"
QUESTION = "Switch pgc-01's primary to its synchronous standby? Writes pause for a few seconds; nothing is lost."


def new_page(browser: Browser, problems: list[str]) -> Page:
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    page: Page = context.new_page()
    page.set_default_timeout(10_000)
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    return page


def switchover_requests(page: Page) -> list[Request]:
    seen: list[Request] = []
    page.on("request", lambda r: seen.append(r) if r.url.endswith("/switchover") else None)
    return seen


def click_listeners(page: Page, selector: str) -> int:
    """How many click listeners the first element matching `selector` has itself (Chrome DevTools)."""
    cdp = page.context.new_cdp_session(page)
    try:
        found = cdp.send("Runtime.evaluate", {"expression": f"document.querySelector({selector!r})"})
        listeners = cdp.send("DOMDebugger.getEventListeners", {"objectId": found["result"]["objectId"]})
        return sum(1 for listener in listeners["listeners"] if listener["type"] == "click")
    finally:
        cdp.detach()


def test_buttons_on_live_api(browser: Browser, live_api: LiveApi) -> None:
    """A button per row, named for its instance; with no standby it is disabled and says why, and
    neither a click nor the keyboard sends anything."""
    problems: list[str] = []
    page = new_page(browser, problems)
    sent = switchover_requests(page)
    try:
        page.goto(live_api.base_url + "/")
        expect(page.get_by_test_id("instance-row")).to_have_count(len(live_api.instances))
        for name in live_api.instances:
            button = page.locator(ROW.format(name)).get_by_test_id("switchover-button")
            expect(button).to_have_accessible_name(f"Switch over {name}")
            expect(button).to_have_text("switch over")
            expect(button).to_have_attribute("aria-disabled", "true")
            expect(button).to_be_disabled()
            expect(button).to_have_attribute("title", f"{name} has no running standby to switch over to")
        # One delegated click handler on the table body; none on the rows' buttons (the table
        # holds hundreds of rows).
        assert click_listeners(page, '[data-testid="instances-body"]') == 1
        assert click_listeners(page, '[data-testid="switchover-button"]') == 0
        # Reachable by the keyboard (so is its reason); Enter only repeats why.
        button = page.get_by_role("button", name="Switch over pgc-01")
        button.focus()
        expect(button).to_be_focused()
        page.keyboard.press("Enter")
        expect(page.get_by_test_id("switchover-message")).to_have_text(
            "Not switched over: pgc-01 has no running standby to switch over to.")
        expect(page.get_by_test_id("switchover-dialog")).to_be_hidden()
        expect(page.get_by_test_id("token-dialog")).to_be_hidden()
        assert sent == []
    finally:
        page.context.close()
    assert not problems, problems


def stubbed_instances(live_api: LiveApi) -> list[dict[str, Any]]:
    """The live instances, with the standbys a real fleet would have: pgc-01's two stream (one
    sync), pgc-02's primary is shut off."""
    docs = live_api.service.instance_docs()
    docs[0]["standbys"] = [
        {"name": "pgc-01-s1", "host": "h2", "state": "streaming", "sync_state": "sync", "replay_lag_bytes": 0},
        {"name": "pgc-01-s2", "host": "h3", "state": "streaming", "sync_state": "potential", "replay_lag_bytes": 512},
    ]
    docs[1]["state"] = "shut-off"
    docs[1]["standbys"] = [
        {"name": "pgc-02-s1", "host": "h2", "state": "not streaming", "sync_state": None, "replay_lag_bytes": None},
    ]
    return docs


class ScriptedOperation:
    """GET /v1/operations/OP_ID: running until released, then succeeded with a write pause."""

    def __init__(self) -> None:
        self.released = False
        self.reads = 0
        created = time.time()
        self.doc: dict[str, Any] = {
            "id": OP_ID, "kind": "switchover", "status": "running", "target": 1, "progress": 0.5,
            "message": "pgc-01-s2: replaying what the primary wrote", "error": None, "created_at": created,
            "started_at": created, "finished_at": None, "steps": {},
            "params": {"instance": "pgc-01", "to": "pgc-01-s2"}, "result": {},
        }

    def handle(self, route: Route) -> None:
        self.reads += 1
        doc = dict(self.doc)
        if self.released:
            doc.update(status="succeeded", progress=1.0, finished_at=time.time(),
                       message="switched over from pgc-01 to pgc-01-s2 on h3; writes paused 2.4 s",
                       result={"new_primary": "pgc-01-s2", "host": "h3", "write_pause_s": 2.43})
        route.fulfill(json=doc)


def test_confirmed_switchover_is_sent_and_followed(browser: Browser, live_api: LiveApi) -> None:
    problems: list[str] = []
    page = new_page(browser, problems)
    sent = switchover_requests(page)
    docs = stubbed_instances(live_api)
    dialog = page.get_by_test_id("switchover-dialog")
    question = page.get_by_test_id("switchover-question")
    target = page.get_by_test_id("switchover-target")
    message = page.get_by_test_id("switchover-message")
    try:
        page.route("**/v1/instances?include=retired", lambda route: route.fulfill(json=docs))
        page.goto(live_api.base_url + "/")
        first = page.get_by_role("button", name="Switch over pgc-01")
        second = page.get_by_role("button", name="Switch over pgc-02")
        expect(first).to_have_attribute("aria-disabled", "false")
        expect(first).to_be_enabled()
        expect(second).to_have_attribute("aria-disabled", "true")
        expect(second).to_have_attribute(
            "title", "pgc-02's primary is not running (shut-off): there is nothing to switch over from")

        # The keyboard opens the question; the choice defaults to the synchronous standby and
        # lists the running ones. Cancel sends nothing.
        first.focus()
        page.keyboard.press("Enter")
        expect(dialog).to_be_visible()
        expect(page.get_by_test_id("switchover-title")).to_have_text("Switch over pgc-01")
        expect(question).to_have_text(QUESTION)
        expect(target).to_have_value("")
        expect(target.locator("option")).to_have_text(
            ["the synchronous standby", "pgc-01-s1 on h2 (sync, streaming)", "pgc-01-s2 on h3 (potential, streaming)"])
        expect(page.get_by_label("New primary")).to_be_visible()
        page.get_by_test_id("switchover-cancel").click()
        expect(dialog).to_be_hidden()

        # Confirmed, to a chosen standby, with no token kept yet: the token is asked for the way
        # the scale control asks. The real API has no such standby and says so in its words.
        first.click()
        target.select_option("pgc-01-s2")
        expect(question).to_have_text(
            "Switch pgc-01's primary to pgc-01-s2 on h3? Writes pause for a few seconds; nothing is lost.")
        OUTPUT.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(OUTPUT / "dashboard-switchover-confirm.png"))
        page.get_by_test_id("switchover-confirm").click()
        expect(page.get_by_test_id("token-dialog")).to_be_visible()
        page.get_by_test_id("token-input").fill(live_api.token)
        with page.expect_response(re.compile(r"/v1/instances/pgc-01/switchover$")) as refused:
            page.get_by_test_id("token-submit").click()
        detail = refused.value.json()["detail"]
        assert refused.value.status == 404 and "pgc-01-s2" in detail, (refused.value.status, detail)
        expect(message).to_have_text(f"pgc-01 not switched over: {detail}")
        expect(message).to_have_class(re.compile(r"\berror\b"))
        assert len(sent) == 1

        # Now intercepted: 202 and a scripted operation the page follows.
        accepted: list[Request] = []
        operation = ScriptedOperation()

        def accept(route: Route) -> None:
            accepted.append(route.request)
            route.fulfill(status=202, json={"operation": OP_ID, "status": "pending", "kind": "switchover"})

        page.route("**/v1/instances/pgc-01/switchover", accept)
        page.route(f"**/v1/operations/{OP_ID}", operation.handle)
        first.click()
        target.select_option("pgc-01-s2")
        page.get_by_test_id("switchover-confirm").click()
        expect(message).to_have_text(f"Accepted: switching pgc-01 over to pgc-01-s2 (operation {OP_ID}).")
        expect(page.get_by_test_id("token-dialog")).to_be_hidden()  # kept from the first time
        assert len(sent) == 2 and len(accepted) == 1
        request = accepted[0]
        assert request.method == "POST"
        assert request.url == f"{live_api.base_url}/v1/instances/pgc-01/switchover"
        assert request.headers.get("authorization") == f"Bearer {live_api.token}"
        assert request.headers.get("content-type") == "application/json"
        assert request.post_data_json == {"to": "pgc-01-s2"}

        # Followed where operations are shown: running at half-way, the instance's button
        # disabled meanwhile; then the outcome with the write pause.
        op = page.locator(f'[data-testid="operation"][data-op-id="{OP_ID}"]')
        expect(op).to_have_attribute("data-status", "running")
        expect(op.get_by_test_id("operation-title")).to_have_text("Switch over pgc-01")
        expect(op.get_by_test_id("operation-progress")).to_have_attribute("aria-valuenow", "50")
        expect(op.get_by_test_id("operation-message")).to_contain_text("pgc-01-s2: replaying what the primary wrote")
        expect(first).to_have_attribute("aria-disabled", "true")
        expect(first).to_have_attribute("title", "an operation on pgc-01 is under way")
        operation.released = True
        expect(op).to_have_attribute("data-status", "succeeded")
        expect(op.get_by_test_id("operation-message")).to_have_text(
            re.compile(r"^switched over to pgc-01-s2 on h3; writes paused 2\.4 s · "))
        expect(op.get_by_test_id("operation-error")).to_have_count(0)
        expect(message).to_have_text("pgc-01: switched over to pgc-01-s2 on h3; writes paused 2.4 s")
        expect(first).to_have_attribute("aria-disabled", "false")
        assert len(accepted) == 1, "one confirmed click, one request"
        page.wait_for_function("() => document.readyState === 'complete'", polling="raf")
        page.screenshot(path=str(OUTPUT / "dashboard-switchover.png"), full_page=True)
    finally:
        page.context.close()
    # The API's 404 is logged by Chromium as a failed resource; anything else is a bug.
    unexpected = [p for p in problems if "status of 404" not in p]
    assert not unexpected, unexpected
