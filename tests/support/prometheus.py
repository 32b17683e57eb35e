"""A real Prometheus (Debian's `prometheus` package) scraping a pgcarve API, for tests.

`running_prometheus()` starts the server on 127.0.0.1 (a free port) with its own config and
storage in a directory of the test's, scraping one API with the job from
monitoring/prometheus/prometheus.example.yml and the given rule files, every `interval_s`; it
waits until the server is ready and stops it by PID afterwards. `shortened_rules()` writes a copy
of pgcarve's rules whose `for:` durations are at most a few seconds, so an alert can fire within
a test; the shipped rules are never changed for a test's sake.

prometheus_watching() puts both together; tests/monitoring uses it on libvirt's test driver, and
the sandbox's fault tests (tests/integration) can use it as it is.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "monitoring"
RULES_FILE = MONITORING / "prometheus" / "pgcarve-rules.yml"
EXAMPLE_CONFIG = MONITORING / "prometheus" / "prometheus.example.yml"
RULE_TESTS = MONITORING / "prometheus" / "tests" / "pgcarve-rules.test.yml"
DASHBOARD = MONITORING / "grafana" / "pgcarve-dashboard.json"
MISSING = "Debian's prometheus package is not installed (make apt installs it): no {0} in PATH"


def tool(name: str) -> str:
    """Path of `prometheus` or `promtool`; AssertionError in operator words if missing."""
    found = shutil.which(name)
    if found is None:
        raise AssertionError(MISSING.format(name))
    return found


_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_s(text: str) -> float:
    """A Prometheus duration ("1m30s", "5m") in seconds."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * _SECONDS[u] for n, u in parts)


def shortened_rules(dest: Path, for_s: int = 2, source: Path = RULES_FILE) -> Path:
    """Write a copy of `source` to `dest` with every alert's `for:` cut to at most `for_s` seconds."""
    doc = yaml.safe_load(source.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule and duration_s(str(rule["for"])) > for_s:
                rule["for"] = f"{for_s}s"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(yaml.safe_dump(doc, sort_keys=False, width=1000))
    return dest


def scrape_config(target_url: str, interval_s: float, token: str | None = None) -> dict[str, Any]:
    """The example config's pgcarve job, aimed at `target_url` and scraping every `interval_s`."""
    example = yaml.safe_load(EXAMPLE_CONFIG.read_text())
    job = dict(next(j for j in example["scrape_configs"] if j["job_name"] == "pgcarve"))
    parts = urlsplit(target_url)
    job["static_configs"] = [{"targets": [parts.netloc]}]
    job["scheme"] = parts.scheme or "http"
    job["scrape_interval"] = f"{int(interval_s * 1000)}ms"
    job["scrape_timeout"] = f"{int(interval_s * 1000)}ms"
    if token is not None:
        job["authorization"] = {"type": "Bearer", "credentials": token}
    return job


def series_labels(metric: Mapping[str, str]) -> str:
    """A series' labels as one short string, for error messages."""
    return ",".join(f"{k}={v}" for k, v in sorted(metric.items()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def _get(self, path: str, **params: str) -> Any:
        resp = httpx.get(self.url + path, params=params, timeout=10)
        body = resp.json()
        if resp.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"Prometheus {path} {params}: HTTP {resp.status_code}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query, now or `at` (Unix time); the result vector (or raises with Prometheus's error)."""
        data = self._get("/api/v1/query", query=expr, **({} if at is None else {"time": f"{at:.3f}"}))
        result: list[dict[str, Any]] = data["result"] if data["resultType"] == "vector" else [data]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        """Active alerts (pending or firing); a resolved alert is no longer listed."""
        alerts: list[dict[str, Any]] = self._get("/api/v1/alerts")["alerts"]
        return alerts

    def find_alerts(self, name: str, labels: Mapping[str, str] | None = None,
                    state: str | None = None) -> list[dict[str, Any]]:
        want = dict(labels or {}, alertname=name)
        return [a for a in self.alerts() if want.items() <= a["labels"].items()
                and (state is None or a["state"] == state)]

    def wait_for_alert(self, name: str, labels: Mapping[str, str] | None = None, state: str = "firing",
                       timeout_s: float = 30) -> dict[str, Any]:
        """The first alert `name` with `labels` in `state`; AssertionError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.find_alerts(name, labels, state)
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"alert {name} {dict(labels or {})} not {state} after {timeout_s} s; "
                                     f"active alerts: {[(a['labels'], a['state']) for a in self.alerts()]}")
            self._check_alive()
            time.sleep(0.2)

    def wait_for_no_alert(self, name: str, labels: Mapping[str, str] | None = None, timeout_s: float = 30) -> None:
        """Until alert `name` with `labels` is neither pending nor firing (resolved)."""
        deadline = time.monotonic() + timeout_s
        while self.find_alerts(name, labels):
            if time.monotonic() > deadline:
                raise AssertionError(f"alert {name} {dict(labels or {})} still active after {timeout_s} s")
            self._check_alive()
            time.sleep(0.2)

    def wait_for_scrapes(self, count: int = 2, timeout_s: float = 30) -> None:
        """Until the target was scraped successfully `count` times in a row (`up` is 1 throughout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(f'count_over_time(up{{job="pgcarve"}}[1h]) >= {count} and up{{job="pgcarve"}} == 1')
            if result:
                return
            if time.monotonic() > deadline:
                targets = self._get("/api/v1/targets")["activeTargets"]
                raise AssertionError(f"Prometheus did not scrape pgcarve {count} times in {timeout_s} s: "
                                     f"{[(t['scrapeUrl'], t['health'], t['lastError']) for t in targets]}")
            self._check_alive()
            time.sleep(0.2)

    def wait_for_samples(self, selector: str, count: int, *, series: int, timeout_s: float = 60) -> None:
        """Until `series` series match `selector`, each with at least `count` samples in the last minute."""
        query = f"count_over_time({selector}[1m]) >= {count}"
        deadline = time.monotonic() + timeout_s
        while len(self.query(query)) < series:
            if time.monotonic() > deadline:
                counts = self.query(f"count_over_time({selector}[1m])")
                seen = {series_labels(r["metric"]): r["value"][1] for r in counts}
                raise AssertionError(f"not {series} series of {selector} with {count} samples each after "
                                     f"{timeout_s} s; samples per series: {seen}")
            self._check_alive()
            time.sleep(0.2)

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"Prometheus exited ({self.process.returncode}): {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL if it has not exited within 20 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@contextlib.contextmanager
def running_prometheus(work_dir: Path, target_url: str, rules: list[Path], *, interval_s: float = 1.0,
                       token: str | None = None, ready_timeout_s: float = 30) -> Iterator[Prometheus]:
    """Prometheus on 127.0.0.1 scraping `target_url` and evaluating `rules` every `interval_s`."""
    if urlsplit(target_url).hostname not in ("127.0.0.1", "::1", "localhost"):
        raise ValueError(f"tests scrape loopback only, not {target_url}")
    binary = tool("prometheus")
    work_dir.mkdir(parents=True, exist_ok=True)
    interval = f"{int(interval_s * 1000)}ms"
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(p) for p in rules],
        "scrape_configs": [scrape_config(target_url, interval_s, token)],
    }
    config_file = work_dir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    port = _free_port()
    log = work_dir / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [binary, f"--config.file={config_file}", f"--storage.tsdb.path={work_dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    prom = Prometheus(url=f"http://127.0.0.1:{port}", process=process, log=log)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            prom._check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(prom.url + "/-/ready", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"Prometheus was not ready within {ready_timeout_s} s: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield prom
    finally:
        prom.stop()


@contextlib.contextmanager
def prometheus_watching(work_dir: Path, api_url: str, for_s: int = 2) -> Iterator[Prometheus]:
    """Prometheus scraping a running pgcarve API every second with pgcarve's rules, `for:` cut to
    `for_s` seconds, yielded once it has scraped the API twice. For the monitoring tests on the
    test driver, and for the sandbox's fault tests (tests/integration)."""
    rules = shortened_rules(work_dir / "rules" / "pgcarve-rules.yml", for_s)
    with running_prometheus(work_dir / "prometheus", api_url, [rules]) as prom:
        prom.wait_for_scrapes(2)
        yield prom
