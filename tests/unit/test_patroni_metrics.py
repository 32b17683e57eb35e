"""/metrics under Patroni: the leader, synchronous standbys, members and timeline of each
instance, from Patroni's keys as a real Patroni 4.0 wrote them (tests/data/patroni), read from
the last listing and never from etcd at scrape time."""

from __future__ import annotations

from pgcarve.config import EtcdConfig
from pgcarve.control.patroni_roles import PatroniClusters
from pgcarve.patroni.view import cluster_views
from pgcarve_api.patroni_metrics import PatroniMetrics
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from tests.unit.test_patroni_view import recorded

ETCD = EtcdConfig(endpoints=["https://127.0.0.1:1"], ca_file="/nonexistent/ca.pem", cert_file="/nonexistent/c.pem",
                  key_file="/nonexistent/c.key")


def scrape(clusters: PatroniClusters) -> str:
    registry = CollectorRegistry()
    registry.register(PatroniMetrics(clusters))
    return generate_latest(registry).decode()


def test_before_the_first_listing_nothing_is_claimed_and_etcd_is_not_asked() -> None:
    body = scrape(PatroniClusters(ETCD))  # its files do not exist: a read would raise
    assert "pgcarve_patroni_has_leader{" not in body and "# TYPE pgcarve_patroni_has_leader gauge" in body


def test_a_steady_instance_and_one_after_a_switchover() -> None:
    clusters = PatroniClusters(ETCD)
    kvs, revision = recorded("patroni-4.0.7", "steady")
    moved, _ = recorded("patroni-4.0.7", "after_switchover", scope="pgc-02")
    clusters._views, clusters._read_at = cluster_views([*kvs, *moved], revision), 1.0
    body = scrape(clusters)
    steady, after = clusters._views["pgc-01"], clusters._views["pgc-02"]
    assert steady.leader and after.leader and steady.leader != after.leader
    assert 'pgcarve_patroni_has_leader{instance="pgc-01"} 1.0' in body
    assert f'pgcarve_patroni_leader{{guest="{steady.leader.replace("_", "-")}",instance="pgc-01"}} 1.0' in body
    for standby in steady.synchronous_standbys:
        assert f'pgcarve_patroni_synchronous_standby{{guest="{standby.replace("_", "-")}",instance="pgc-01"}}' in body
    assert (f'pgcarve_patroni_synchronous_standbys{{instance="pgc-01"}} '
            f'{float(len(steady.synchronous_standbys))}') in body
    assert f'pgcarve_patroni_timeline{{instance="pgc-02"}} {float(after.timeline or 0)}' in body
    assert after.timeline is not None and steady.timeline is not None and after.timeline > steady.timeline
    assert body.count("pgcarve_patroni_member_running{") == len(steady.members) + len(after.members)


def test_a_retired_instances_kept_keys_raise_no_alert() -> None:
    clusters = PatroniClusters(ETCD)
    kvs, revision = recorded("patroni-4.0.7", "steady")
    retired, _ = recorded("patroni-4.0.7", "steady", scope="pgc-02")
    # Retired: its members and leader keys expired with their leases; config, sync and the
    # initialize key stay for its return.
    kept = [kv for kv in retired if not kv.key.endswith("/leader") and "/members/" not in kv.key]
    assert kept and len(kept) < len(retired)
    clusters._views, clusters._read_at = cluster_views([*kvs, *kept], revision), 1.0
    body = scrape(clusters)
    assert 'pgcarve_patroni_has_leader{instance="pgc-01"} 1.0' in body
    assert 'instance="pgc-02"' not in body, "PgcarvePatroniNoLeader would page for an instance nobody runs"
