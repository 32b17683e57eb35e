"""pgcarve's Prometheus rules: valid (`promtool check rules`), every alert unit-tested
(`promtool test rules`), actionable, and built only on series /metrics exports."""

from __future__ import annotations

import re
from typing import Any

import yaml

from tests.monitoring.conftest import Monitored, make_everything_happen, promtool
from tests.support.prometheus import EXAMPLE_CONFIG, RULE_TESTS, RULES_FILE, duration_s, shortened_rules

SEVERITIES = {"critical", "warning", "info"}
# A name in PromQL that is not followed by "(" (a function or an aggregation).
NAME = re.compile(r"\b[a-zA-Z_][\w:]*\b(?!\s*\()")
KEYWORDS = {"by", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "without", "offset", "bool"}


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES_FILE.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [r for r in rules() if "alert" in r]


def metric_names(expr: str) -> set[str]:
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)  # selectors, ranges and strings out
    bare = re.sub(r"\b(by|on|ignoring|without|group_left|group_right)\s*\([^)]*\)", " ", bare)
    return {n for n in NAME.findall(bare) if n not in KEYWORDS}


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", str(RULES_FILE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout, result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout, result.stdout


def test_every_rule_is_unit_tested_firing_and_quiet() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    firing: set[str] = set()
    quiet: set[str] = set()
    exprs = ""
    for test in doc["tests"]:
        for case in test.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
        exprs += " ".join(case["expr"] for case in test.get("promql_expr_test", []))
    names = {a["alert"] for a in alerts()}
    assert names - firing == set(), f"alerts never tested firing: {sorted(names - firing)}"
    assert names - quiet == set(), f"alerts never tested staying quiet: {sorted(names - quiet)}"
    recorded = {r["record"] for r in rules() if "record" in r}
    assert {r for r in recorded if r not in exprs} == set()


def test_alerts_are_actionable() -> None:
    assert len(alerts()) >= 11
    for alert in alerts():
        name = alert["alert"]
        assert re.fullmatch(r"Pgcarve[A-Z]\w+", name), name
        assert alert["labels"]["severity"] in SEVERITIES, name
        summary, description = alert["annotations"]["summary"], alert["annotations"]["description"]
        assert len(summary) < 100 and "\n" not in summary, name
        # What it means, then what to look at: an API path or a command.
        assert "Next:" in description, name
        assert re.search(r"GET /v1/|`pgcarve |`virsh|server\.log", description.split("Next:")[1]), name


def test_shipped_for_durations_are_production_values(tmp_path) -> None:
    """Tests shorten `for:` in copies (shortened_rules); the shipped file keeps its own."""
    durations = {a["alert"]: duration_s(a["for"]) for a in alerts() if "for" in a}
    assert durations and min(durations.values()) >= 30, durations
    copy = yaml.safe_load(shortened_rules(tmp_path / "short.yml", 2).read_text())
    short = [r for g in copy["groups"] for r in g["rules"] if "alert" in r]
    assert {r["alert"]: r.get("for") for r in short} == {a: "2s" for a in durations} | {
        a["alert"]: None for a in alerts() if "for" not in a}
    assert [r["expr"] for r in short] == [a["expr"] for a in alerts()]


def test_rules_use_only_exported_series(monitored: Monitored) -> None:
    make_everything_happen(monitored)
    exported = set(re.findall(r"^(\w+)(?:\{| )", monitored.metrics(), re.MULTILINE)) - {"#"}
    recorded = {r["record"] for r in rules() if "record" in r}
    for rule in rules():
        used = metric_names(rule["expr"]) - {"up", "time", "vector"}
        unknown = used - exported - recorded
        assert not unknown, f"{rule.get('alert') or rule.get('record')} uses series nobody exports: {unknown}"
    assert metric_names('sum by (job) (rate(pgcarve_x_total{a="b"}[1m])) <= on (job) group_left () y:z:w') == {
        "pgcarve_x_total", "y:z:w"}


def test_example_config_is_valid(tmp_path) -> None:
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    job = config["scrape_configs"][0]
    assert job["job_name"].startswith("pgcarve") and job["honor_labels"] is True
    config["rule_files"] = [str(RULES_FILE)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
