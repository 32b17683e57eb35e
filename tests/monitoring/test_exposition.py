"""/metrics follows Prometheus's conventions (`promtool check metrics`) and says what the service
knows: a real app on libvirt's test driver, with every kind of fact made to happen."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.monitoring.conftest import Monitored, make_everything_happen, promtool

REPO = Path(__file__).resolve().parents[2]


def samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(series name, sorted labels): value}; fails on a series given twice."""
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in found, f"series exported twice: {key}"
            found[key] = s.value
    return found


def value(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return found[(name, tuple(sorted(labels.items())))]


def test_promtool_check_metrics_passes(monitored: Monitored) -> None:
    make_everything_happen(monitored)
    body = monitored.metrics()
    result = promtool("check", "metrics", stdin=body)
    assert result.returncode == 0 and result.stdout == "" and result.stderr == "", (
        f"promtool check metrics: {result.stdout}{result.stderr}")
    # Every family has HELP and TYPE, and counters are exposed as *_total.
    families = re.findall(r"^# TYPE (\S+) (\S+)$", body, re.MULTILINE)
    helps = set(re.findall(r"^# HELP (\S+) ", body, re.MULTILINE))
    assert {name for name, _ in families} == helps
    assert len(families) >= 30, families
    for name, kind in families:
        assert name.startswith("pgcarve_"), name
        assert kind in ("counter", "gauge"), (name, kind)
        assert (kind == "counter") == name.endswith("_total"), (name, kind)


def test_series_say_what_the_service_knows(monitored: Monitored) -> None:
    make_everything_happen(monitored)
    found = samples(monitored.metrics())
    # Throughput counters come from the collector's samples, raw and client.
    xacts = value(found, "pgcarve_xact_total", instance="pgc-01", host="h1")
    assert xacts >= 1_000_000
    assert value(found, "pgcarve_client_xact_total", instance="pgc-01", host="h1") > 0
    assert value(found, "pgcarve_client_statements_total", instance="pgc-03", host="h1") > 0
    assert value(found, "pgcarve_collector_last_round_timestamp_seconds") > 1.6e9
    assert value(found, "pgcarve_collector_last_success_timestamp_seconds", instance="pgc-02", host="h1") > 1.6e9

    assert value(found, "pgcarve_instances") == 3
    for name in ("pgc-01", "pgc-02", "pgc-03"):
        assert value(found, "pgcarve_instance_up", instance=name, host="h1") == 1
        assert value(found, "pgcarve_instance_vcpus", instance=name, host="h1") == 2
    assert value(found, "pgcarve_collector_poll_error", instance="pgc-03", host="h1") == 1
    assert value(found, "pgcarve_collector_poll_error", instance="pgc-01", host="h1") == 0
    assert value(found, "pgcarve_instance_commits_waiting", instance="pgc-02", host="h1") == 2
    assert value(found, "pgcarve_instance_commits_waiting", instance="pgc-01", host="h1") == 0

    # Replication: streaming standbys by sync state (zero-filled), lag per standby; nothing for
    # pgc-03, whose last poll failed (its rows would be the past).
    assert value(found, "pgcarve_instance_streaming_standbys", instance="pgc-01", sync_state="sync") == 1
    assert value(found, "pgcarve_instance_streaming_standbys", instance="pgc-01", sync_state="potential") == 1
    assert value(found, "pgcarve_instance_streaming_standbys", instance="pgc-02", sync_state="potential") == 0
    assert value(found, "pgcarve_standby_replay_lag_bytes", instance="pgc-01", standby="pgc_01_s2",
                 sync_state="potential") == 5 << 20
    assert not [k for k in found if k[0].startswith("pgcarve_instance_streaming") and ("instance", "pgc-03") in k[1]]

    # Hosts: libvirt's view and the event subscription.
    assert value(found, "pgcarve_host_events_connected", host="h1") == 1
    assert value(found, "pgcarve_host_cpus", host="h1", role="primary") == 16
    assert value(found, "pgcarve_host_guests", host="h1") == 3
    assert value(found, "pgcarve_host_pinned_cpus", host="h1") == 6

    # Operations: the failed scale-up, nothing left active.
    assert value(found, "pgcarve_operations_accepted_total") == 1
    assert value(found, "pgcarve_operations_total", result="failed") == 1
    assert value(found, "pgcarve_operations_total", result="succeeded") == 0
    assert value(found, "pgcarve_operations_active", status="running") == 0

    # Incidents: counted by what at detection and by action/status when they end; open ones per
    # instance (two on pgc-02 are one series of value 2), since when, and the last failover.
    assert value(found, "pgcarve_incidents_total", what="standby stopped") == 2
    assert value(found, "pgcarve_incidents_total", what="primary stopped") == 2
    assert value(found, "pgcarve_incidents_ended_total", action="failover", status="recovered") == 1
    assert value(found, "pgcarve_incidents_ended_total", action="restart", status="failed") == 1
    assert value(found, "pgcarve_incidents_ended_total", action="rebuild", status="recovered") == 0
    assert value(found, "pgcarve_incidents_open", instance="pgc-02") == 2
    assert value(found, "pgcarve_incidents_open", instance="pgc-03") == 1
    assert value(found, "pgcarve_incidents_open", instance="pgc-01") == 0
    sup = monitored.supervisor
    stuck = next(i for i in sup.incidents() if i.instance == "pgc-03")
    assert value(found, "pgcarve_incident_open_since_timestamp_seconds", instance="pgc-03",
                 what="primary stopped") == stuck.detected_at
    failover = next(i for i in sup.incidents() if i.action == "failover")
    assert value(found, "pgcarve_instance_last_failover_timestamp_seconds", instance="pgc-01") == failover.finished_at


def test_an_ending_counts_once_and_a_retried_repair_again(monitored: Monitored) -> None:
    sup = monitored.supervisor
    incident = sup.record("pgc-01", "primary stopped")
    assert value(samples(monitored.metrics()), "pgcarve_incidents_ended_total", action="restart", status="failed") == 0
    sup.finish(incident, "failed", "restart", "could not start the guest", finished_at=100.0)
    for _ in range(2):  # scraped twice: counted once
        found = samples(monitored.metrics())
        assert value(found, "pgcarve_incidents_ended_total", action="restart", status="failed") == 1
        assert value(found, "pgcarve_incidents_open", instance="pgc-01") == 1
    sup.finish(incident, "failed", "restart", "could not start the guest", finished_at=130.0)  # the retry failed too
    sup.finish(incident, "recovered", "restart", "restarted pgc-01", finished_at=160.0)
    found = samples(monitored.metrics())
    # Seen at scrape time: the second failure ended between two scrapes and is not seen.
    assert value(found, "pgcarve_incidents_ended_total", action="restart", status="failed") == 1
    assert value(found, "pgcarve_incidents_ended_total", action="restart", status="recovered") == 1
    assert value(found, "pgcarve_incidents_open", instance="pgc-01") == 0


def test_readme_lists_every_series(monitored: Monitored) -> None:
    make_everything_happen(monitored)
    body = monitored.metrics()
    names = set(re.findall(r"^# TYPE (\S+) ", body, re.MULTILINE))
    docs = (REPO / "monitoring" / "README.md").read_text()
    undocumented = sorted(n for n in names if f"`{n}" not in docs)
    assert not undocumented, f"series missing from monitoring/README.md: {undocumented}"
