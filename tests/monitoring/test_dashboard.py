"""The Grafana dashboard (monitoring/grafana/pgcarve-dashboard.json): well formed, laid out on
Grafana's 24-column grid without overlaps, every query on pgcarve's recording rules and series
through the datasource variable, and every concern of the issue on it. test_prometheus.py runs
each query against a real Prometheus."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from tests.monitoring.test_rules import metric_names
from tests.support.prometheus import DASHBOARD, RULES_FILE

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def test_dashboard_is_well_formed() -> None:
    doc = dashboard()
    assert doc["uid"] == "pgcarve-fleet" and doc["title"] == "pgcarve"
    assert isinstance(doc["schemaVersion"], int)
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["includeAll"] and variables["instance"]["allValue"] == ".*"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in doc["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        taken = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not taken & cells, f"{panel['title']} overlaps another panel"
        cells |= taken
        if panel["type"] == "row":
            continue
        assert panel["description"], panel["title"]
        assert panel["datasource"] == DATASOURCE, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == DATASOURCE and t["expr"].strip(), panel["title"]


def test_queries_use_only_recording_rules_and_pgcarve_series() -> None:
    doc = dashboard()
    recorded = {r["record"] for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"]
                if "record" in r}
    used: set[str] = set()
    for panel in doc["panels"]:
        for t in panel.get("targets", []):
            names = metric_names(t["expr"])
            assert all(n.startswith("pgcarve_") or n in recorded for n in names), (panel["title"], names)
            # Per-instance throughput only through the recording rules: one definition for all.
            assert not re.search(r"\brate\(pgcarve_(client_)?(xact|statements)_total", t["expr"]), panel["title"]
            used |= names
    # Aggregate and per-instance TPS and QPS, lag, writes waiting, incidents, pinning, operations.
    assert recorded <= used
    assert {"pgcarve_standby_replay_lag_bytes", "pgcarve_instance_commits_waiting", "pgcarve_incidents_open",
            "pgcarve_incidents_total", "pgcarve_incident_open_since_timestamp_seconds",
            "pgcarve_host_pinned_cpus", "pgcarve_instance_pinned_cpu", "pgcarve_operations_total"} <= used
