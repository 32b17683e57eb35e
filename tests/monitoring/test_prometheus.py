"""A real Prometheus (Debian's package, on 127.0.0.1) scrapes the live API on libvirt's test
driver with pgcarve's rules; faults are made and repaired, and the matching alerts fire and
resolve. The rules' `for:` is cut to 2 s in a copy (the shipped file is untouched), scrapes and
evaluations run every second."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from tests.monitoring.conftest import Monitored
from tests.support.fakes import standby
from tests.support.prometheus import DASHBOARD, prometheus_watching

# Grafana's variables, as the dashboard's queries would be sent for "all instances".
GRAFANA_VARIABLES = {"$job": "pgcarve", "$instance": ".*", "$__rate_interval": "1m", "$__interval": "15s",
                     "$__range": "1h"}
# Scrapes of each instance's counter before its rate is compared with the others'.
SAMPLES = 6


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel or annotation title, PromQL) for every query of the Grafana dashboard."""
    doc = json.loads(DASHBOARD.read_text())
    found = [(panel["title"], target["expr"]) for panel in doc["panels"] for target in panel.get("targets", [])]
    found += [(a["name"], a["expr"]) for a in doc["annotations"]["list"] if "expr" in a]
    resolved = []
    for title, expr in found:
        for name, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, f"{title}: unknown variable in {expr}"
        resolved.append((title, expr))
    return resolved


def test_alerts_fire_and_resolve_in_a_real_prometheus(monitored: Monitored, tmp_path: Path) -> None:
    api = monitored.api
    started = time.monotonic()
    with prometheus_watching(tmp_path, api.base_url, for_s=2) as prom:
        timings: dict[str, float] = {"prometheus ready, 2 scrapes done": time.monotonic() - started}

        # Healthy: the recording rules carry each instance's fed throughput and their sum.
        # (rate() over [1m] divides by the whole minute, so a younger series reads low: the test
        # compares instances with each other, not with the feeder's absolute rates.)
        # Feeds and scrapes both tick every second, unsynchronised: two scrapes can fall between
        # the same two feeds (a rate of 0), and a scrape can catch one instance fed and the next
        # not yet. Over SAMPLES scrapes that is at most one feed out of several, which cannot
        # reorder instances fed at ~9000, ~3500 and ~500 TPS.
        prom.wait_for_samples('pgcarve_client_xact_total{job="pgcarve"}', SAMPLES, series=len(api.instances))
        timings[f"{SAMPLES} samples of every instance"] = time.monotonic() - started
        # Both read at one moment after a whole evaluation: the rule group writes each rule's
        # result as it goes, so "now" could mix one instance evaluation with the next fleet one.
        at = time.time()
        deadline = time.monotonic() + 30
        while not prom.query(f'timestamp(job:pgcarve_client_xact:rate1m{{job="pgcarve"}}) > {at}'):
            assert time.monotonic() < deadline, "the recording rules were not evaluated within 30 s"
            time.sleep(0.2)
        per = {r["metric"]["instance"]: float(r["value"][1])
               for r in prom.query('instance:pgcarve_client_xact:rate1m{job="pgcarve"}', at=at)}
        fleet_result = prom.query('job:pgcarve_client_xact:rate1m{job="pgcarve"}', at=at)
        fleet = float(fleet_result[0]["value"][1]) if fleet_result else 0.0
        assert set(per) == set(api.instances), per
        # Fed at ~9000, ~3500 and ~500 TPS (+-20%).
        assert per["pgc-01"] > per["pgc-02"] > per["pgc-03"] > 0, per
        assert abs(fleet - sum(per.values())) <= 1e-6 * fleet, (fleet, per)
        hosts = {r["metric"]["host"] for r in prom.query("instance:pgcarve_client_statements:rate1m > 0")}
        assert hosts == {"h1"}
        # A healthy fleet raises nothing. The one exception has its own cause: a scrape of /metrics
        # that took over its 1 s timeout on a loaded machine (make test runs this beside booting
        # guests) makes PgcarveManagerDown pending, and then `up` was 0 within the last minute.
        alerts = prom.alerts()
        assert [a for a in alerts if a["labels"]["alertname"] != "PgcarveManagerDown"] == [], alerts
        if alerts:
            lowest_up = prom.query('min_over_time(up{job="pgcarve"}[1m])')
            assert lowest_up and float(lowest_up[0]["value"][1]) == 0, (alerts, lowest_up)
            print("a scrape of /metrics timed out under load: PgcarveManagerDown", alerts[0]["state"])

        # 1. A primary stops (libvirt's test driver destroys the domain): PgcarveInstanceDown.
        t0 = time.monotonic()
        api.domain("pgc-02").destroy()
        alert = prom.wait_for_alert("PgcarveInstanceDown", {"instance": "pgc-02"}, "firing", timeout_s=30)
        timings["instance down: firing"] = time.monotonic() - t0
        assert alert["labels"] == {"alertname": "PgcarveInstanceDown", "instance": "pgc-02", "host": "h1",
                                   "job": "pgcarve", "severity": "critical"}
        assert alert["annotations"]["summary"] == "pgcarve instance pgc-02 is down: its primary does not answer"
        assert "GET /v1/instances/pgc-02" in alert["annotations"]["description"]
        assert [a["labels"]["instance"] for a in prom.alerts()] == ["pgc-02"]
        t0 = time.monotonic()
        api.domain("pgc-02").create()
        prom.wait_for_no_alert("PgcarveInstanceDown", timeout_s=30)
        timings["instance down: resolved"] = time.monotonic() - t0

        # 2. The collector cannot read a running primary: PgcarveInstanceDown too.
        monitored.collector.errors["pgc-03"] = "cannot connect to PostgreSQL on h1: connection refused"
        prom.wait_for_alert("PgcarveInstanceDown", {"instance": "pgc-03"}, "firing", timeout_s=30)
        del monitored.collector.errors["pgc-03"]
        prom.wait_for_no_alert("PgcarveInstanceDown", timeout_s=30)

        # 3. Commits wait for a synchronous standby.
        t0 = time.monotonic()
        monitored.collector.waiting["pgc-01"] = 3
        alert = prom.wait_for_alert("PgcarveCommitsWaiting", {"instance": "pgc-01"}, "firing", timeout_s=30)
        timings["commits waiting: firing"] = time.monotonic() - t0
        assert alert["annotations"]["description"].startswith("3 session(s) on pgc-01 have waited")
        monitored.collector.waiting["pgc-01"] = 0
        prom.wait_for_no_alert("PgcarveCommitsWaiting", timeout_s=30)

        # 4. An incident open for 20 minutes, then repaired; the repair was a failover.
        sup = monitored.supervisor
        incident = sup.record("pgc-01", "primary stopped", detected_at=time.time() - 1200)
        alert = prom.wait_for_alert("PgcarveIncidentOpenTooLong", {"instance": "pgc-01"}, "firing", timeout_s=30)
        assert alert["labels"]["what"] == "primary stopped"
        assert re.match(r'pgc-01: "primary stopped" not repaired after 20m \d+s', alert["annotations"]["summary"])
        sup.finish(incident, "recovered", "failover", "failed over to pgc-01-s1")
        prom.wait_for_no_alert("PgcarveIncidentOpenTooLong", timeout_s=30)
        alert = prom.wait_for_alert("PgcarveFailoverHappened", {"instance": "pgc-01"}, "firing", timeout_s=30)
        assert alert["labels"]["severity"] == "info"

        # 5. A scale operation fails (no guest image here).
        api.service.request_scale(len(api.instances) + 1)
        prom.wait_for_alert("PgcarveScaleOperationFailed", {"result": "failed"}, "firing", timeout_s=30)

        # 6. The manager loses a host's libvirt.
        sup.connected["h1"] = False
        prom.wait_for_alert("PgcarveHostUnreachable", {"host": "h1"}, "firing", timeout_s=30)
        sup.connected["h1"] = True
        prom.wait_for_no_alert("PgcarveHostUnreachable", timeout_s=30)

        # Everything at once, for the dashboard: a primary down, standbys with lag, commits
        # waiting, an incident open. Every query of the dashboard is valid PromQL over these
        # series, and every panel shows data except the one this fleet cannot have (no standbys
        # configured on the test driver, so none can be missing).
        api.domain("pgc-03").destroy()
        monitored.collector.standbys["pgc-01"] = [standby("pgc_01_s1", "sync", 4096),
                                                  standby("pgc_01_s2", "potential", 1 << 20)]
        monitored.collector.waiting["pgc-01"] = 1
        sup.record("pgc-02", "standby stopped", guest="pgc-02-s1", role="standby")
        prom.wait_for_alert("PgcarveCommitsWaiting", {"instance": "pgc-01"}, "firing", timeout_s=30)
        empty = set()
        for title, expr in dashboard_queries():
            if not prom.query(expr):
                empty.add(title)
        assert empty <= {"Instances without a spare standby", "Failovers"}, empty
        timings["whole test"] = time.monotonic() - started
        print("timings (s):", {k: round(v, 1) for k, v in timings.items()})
