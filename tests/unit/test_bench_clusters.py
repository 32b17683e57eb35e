"""The multi-instance case's side of several clusters in one guest (pgcarve/advice/clusters.py,
Fleet.endpoint_at): how each cluster is reached, and the wait until each has its standbys. No guest
boots: the fleet's hosts are libvirt's test driver and PostgreSQL is a stand-in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pgcarve.advice import clusters
from pgcarve.advice.cases import with_size
from pgcarve.control.fleet import Fleet, Guest
from pgcarve.errors import GuestNotReady
from pgcarve.settings import Paths
from pgcarve.virt.domain_xml import InstanceMetadata
from pgcarve.virt.host import GuestInfo

from bench import harness, simulated_hosts
from bench.__main__ import parse_args
from tests.support.testdriver import TestDriverHost


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    config = simulated_hosts.testdriver_config(1, "test:///default")
    hosts = {h.name: TestDriverHost(h.name, h.uri, simulated_hosts.capabilities_xml()) for h in config.hosts}
    fleet = Fleet(config, Paths(tmp_path), hosts=hosts)
    yield fleet
    fleet.close()


def primary(fleet: Fleet) -> Guest:
    host = fleet.config.hosts[0].name
    info = GuestInfo(name="pgcbm0a1b-01", host=host, state="running", vcpu_pins=((2,), (3,)), emulator_cpus=(0,),
                     memory_mib=4096, mac=None,
                     metadata=InstanceMetadata(fleet="pgcbm0a1b", cluster="pgcbm0a1b-01", role="primary", index=1))
    return Guest(info=info, address="10.77.0.12", endpoint=("10.77.0.12", 5432))


def test_each_cluster_is_reached_on_its_own_port(fleet: Fleet) -> None:
    guest = primary(fleet)
    assert clusters.cluster_guest(fleet, guest, 1) is guest
    third = clusters.cluster_guest(fleet, guest, 3)
    assert third.endpoint == ("10.77.0.12", 5434) and third.info == guest.info
    assert fleet.endpoint_at(Guest(info=guest.info, address=None, endpoint=None), 5433) is None


class Server:
    """Each port's answers in turn: an exception to raise or the standbys streaming to it."""

    def __init__(self, answers: dict[int, list[Any]]):
        self.answers = answers
        self.asked: list[int] = []

    @contextlib.contextmanager
    def connect(self, guest: Guest, timeout_s: float = 5.0) -> Iterator[int]:
        assert guest.endpoint is not None
        port = guest.endpoint[1]
        self.asked.append(port)
        answer = self.answers[port][0] if len(self.answers[port]) == 1 else self.answers[port].pop(0)
        if isinstance(answer, Exception):
            raise answer
        yield answer


def test_the_wait_ends_once_every_cluster_has_every_standby(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    both = {"pgcbm0a1b_01_s1", "pgcbm0a1b_01_s2"}
    server = Server({5432: [both], 5433: [psycopg.OperationalError("connection refused\nmore"), {"pgcbm0a1b_01_s1"},
                                          both | {"pg_basebackup"}]})
    monkeypatch.setattr(fleet, "connect", server.connect)
    monkeypatch.setattr(clusters.replication, "streaming_standbys", lambda answer: answer)
    told: list[str] = []
    ready = clusters.wait_clusters(fleet, primary(fleet), 2, ["pgcbm0a1b-01-s1", "pgcbm0a1b-01-s2"], 60,
                                   told.append, poll_s=0)
    assert [g.endpoint for g in ready] == [("10.77.0.12", 5432), ("10.77.0.12", 5433)]
    assert server.asked == [5432, 5433, 5433, 5433]
    assert told == ["pgcbm0a1b-01 cluster 2 (port 5433): connection refused",
                    "pgcbm0a1b-01 cluster 2 (port 5433): streaming standbys ['pgcbm0a1b_01_s1'], waiting for "
                    "['pgcbm0a1b_01_s1', 'pgcbm0a1b_01_s2']"]


def test_the_wait_gives_up_naming_the_cluster(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    server = Server({5432: [{"pgcbm0a1b_01_s1"}], 5433: [psycopg.OperationalError("connection refused")]})
    monkeypatch.setattr(fleet, "connect", server.connect)
    monkeypatch.setattr(clusters.replication, "streaming_standbys", lambda answer: answer)
    with pytest.raises(GuestNotReady, match=r"cluster 2 \(port 5433\) not ready .*connection refused"):
        clusters.wait_clusters(fleet, primary(fleet), 2, ["pgcbm0a1b-01-s1"], 0, poll_s=0)


def test_the_case_is_run_by_default_and_sized_by_instances(fleet: Fleet) -> None:
    cases = parse_args([]).cases
    assert "multi-instance" in cases and "multi-process" not in cases  # the approximation only on request
    assert "multi-process" in parse_args(["--cases", "multi-process"]).cases
    assert set(harness.EXPERIMENT_CASES) >= {"carved", "single", "multi-instance", "no-replica"}
    sized = with_size(fleet.config, vcpus=4, clusters=4)
    assert (sized.instance.vcpus, sized.instance.clusters) == (4, 4)
    assert with_size(fleet.config, vcpus=4).instance.clusters == 1
