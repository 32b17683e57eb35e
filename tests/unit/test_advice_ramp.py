"""The client ramp and per-case client counts of pgcarve.advice.advisor, on a recorded TPS curve
(pgbench itself is replaced: no guest here)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pgcarve.advice import advisor
from pgcarve.advice.cases import with_size
from pgcarve.advice.rounds import CaseGroup
from pgcarve.config import FleetConfig


class OnePrimary:
    """Just what ramp() reads of a Fleet: its first primary and the admin's credentials."""

    credentials = SimpleNamespace(admin_password="x" * 32)
    client_tls = None

    def observe(self) -> list[Any]:
        guest = SimpleNamespace(name="pgcar1234-01", endpoint=("127.0.0.1", 5432))
        return [SimpleNamespace(primary=guest)]


def test_the_ramp_stops_where_more_clients_add_under_5_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    curve = {1: 100.0, 2: 190.0, 4: 350.0, 8: 600.0, 16: 620.0, 32: 640.0}
    asked: list[int] = []

    def fake_pgbench(_name: str, _endpoint: object, _password: str, clients: int, jobs: int, seconds: int,
                     **_kw: object) -> SimpleNamespace:
        asked.append(clients)
        assert 1 <= jobs <= clients and seconds == 5
        return SimpleNamespace(tps=curve[clients])

    monkeypatch.setattr(advisor, "run_pgbench", fake_pgbench)
    clients, steps = advisor.ramp(OnePrimary())  # type: ignore[arg-type]  # a stand-in
    assert clients == 8, "16 clients add 3 %: 8 saturate it"
    assert asked == [1, 2, 4, 8, 16] and steps[-1] == {"clients": 16, "tps": 620.0}


def test_carved_cases_get_at_least_two_clients_per_primary() -> None:
    base = FleetConfig.model_validate({"hosts": [{"name": "h0", "uri": "test:///default"},
                                                 {"name": "h1", "uri": "test:///default", "role": "standby"}],
                                       "replication": {"standbys": 1}})
    groups = (CaseGroup("c8", base, 8, 8, (("carved-8", "carved"),)),
              CaseGroup("s", with_size(base, vcpus=8), 1, 8, (("single", "single"),)),
              CaseGroup("m", with_size(base, vcpus=8, clusters=8), 1, 8, (("multi-instance", "multi-instance"),)))
    assert [g.clients for g in advisor.with_clients(groups, 4)] == [16, 4, 16]
    assert [g.clients for g in advisor.with_clients(groups, 64)] == [64, 64, 64]


def test_case_fleets_run_the_managers_roles_even_in_a_patroni_fleet() -> None:
    etcd = {"endpoints": ["https://127.0.0.1:2379"], "ca_file": "/ca.pem", "cert_file": "/c.pem", "key_file": "/k.pem"}
    base = FleetConfig.model_validate({"hosts": [{"name": "h0", "uri": "test:///default"},
                                                 {"name": "h1", "uri": "test:///default", "role": "standby"}],
                                       "replication": {"standbys": 1, "roles": "patroni"}, "etcd": etcd})
    assert base.replication.roles == "patroni"
    assert with_size(base, vcpus=2).replication.roles == "manager"
    assert with_size(base, vcpus=8, clusters=8).replication.roles == "manager"
