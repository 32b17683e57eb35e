"""Fixtures for the monitoring tests: a live API on libvirt's test driver whose collector and
supervisor are fakes the test controls (tests/support/fakes.py), and promtool."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pgcarve.dcs.watch
import pytest
from pgcarve.control.service import ManagerService

from tests.support.domains import instance_names
from tests.support.etcd import CONFIG as ETCD_CONFIG
from tests.support.etcd import FakeEtcdClient, cluster
from tests.support.fakes import FakeCollector, FakeSupervisor, standby
from tests.support.live_api import LiveApi, serve_live_api
from tests.support.patroni_recorded import recorded_patroni
from tests.support.prometheus import tool

INSTANCES = instance_names(3)


@dataclass
class Monitored:
    """The live API and the fakes behind what it reports."""

    api: LiveApi
    collector: FakeCollector
    supervisor: FakeSupervisor

    def metrics(self) -> str:
        resp = httpx.get(self.api.base_url + "/metrics", timeout=10)
        assert resp.status_code == 200, resp.text
        return resp.text


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], input=stdin, capture_output=True, text=True, timeout=120)


@pytest.fixture
def monitored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Monitored]:
    """Three running instances (pgc-01..03) on host h1, nothing wrong with them yet; an etcd of
    three members (h0, h1, h2) that answers through a fake client (FakeEtcdClient.answer)."""
    collector = FakeCollector()
    supervisor = FakeSupervisor(["h1"])
    monkeypatch.setattr(pgcarve.dcs.watch, "EtcdClient", FakeEtcdClient)
    monkeypatch.setattr(FakeEtcdClient, "answer", cluster(["h0", "h1", "h2"]))
    monkeypatch.setattr(pgcarve.dcs.watch, "POLL_INTERVAL_S", 0.2)

    def install(service: ManagerService) -> None:
        service.fleet.patroni = recorded_patroni()  # type: ignore[assignment]
        service.collector = collector  # type: ignore[assignment]
        service.supervisor = supervisor  # type: ignore[assignment]
        service.config = service.config.model_copy(update={"etcd": ETCD_CONFIG})

    with serve_live_api(tmp_path / "state", len(INSTANCES), prepare=install) as api:
        yield Monitored(api=api, collector=collector, supervisor=supervisor)


def make_everything_happen(m: Monitored) -> None:
    """Every kind of fact /metrics reports: standbys and lag, commits waiting, a poll error,
    open incidents (two on one instance), a failover, a failed repair, a failed scale-up, an etcd
    member down."""
    now = time.time()
    FakeEtcdClient.answer = cluster(["h0", "h1", "h2"], down=["h2"])
    m.collector.standbys["pgc-01"] = [standby("pgc_01_s1", "sync", 1536), standby("pgc_01_s2", "potential", 5 << 20)]
    m.collector.standbys["pgc-02"] = [standby("pgc_02_s1", "sync", 0), standby("pgc_02_s2", None, None, "startup")]
    m.collector.waiting["pgc-02"] = 2
    m.collector.errors["pgc-03"] = "cannot connect to PostgreSQL on h1: connection refused"
    sup = m.supervisor
    for guest in ("pgc-02-s1", "pgc-02-s2"):
        sup.record("pgc-02", "standby stopped", guest=guest, role="standby", detected_at=now - 30)
    failover = sup.record("pgc-01", "primary stopped", detected_at=now - 200)
    sup.finish(failover, "recovered", "failover", "failed over to pgc-01-s1", finished_at=now - 100)
    stuck = sup.record("pgc-03", "primary stopped", detected_at=now - 1000)
    sup.finish(stuck, "failed", "restart", "its host did not answer")
    service = m.api.service
    # No guest image here: the scale-up is accepted, then fails.
    service.request_scale(len(m.api.instances) + 1)
    assert service.wait_idle(30)
    deadline = time.monotonic() + 15
    while 'pgcarve_etcd_member_up{member="h2"} 0.0' not in m.metrics():
        assert time.monotonic() < deadline, "the etcd watch never reported h2 down"
        time.sleep(0.2)
