"""etcd as the manager sees it, in /metrics: each member up or down, and whether there is a quorum.

Read from the last poll of pgcarve.dcs.watch.EtcdWatch (every few seconds, each request bounded),
never from etcd at scrape time. monitoring/prometheus/pgcarve-rules.yml alerts on these
(PgcarveEtcdMemberDown, PgcarveEtcdQuorumLost).
"""

from __future__ import annotations

from collections.abc import Iterator

from pgcarve.dcs.watch import EtcdWatch
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class EtcdMetrics(Collector):
    def __init__(self, watch: EtcdWatch):
        self.watch = watch

    def collect(self) -> Iterator[GaugeMetricFamily]:
        health = self.watch.latest()
        up = GaugeMetricFamily("pgcarve_etcd_member_up", "1 if the etcd member answered the manager's last poll "
                               "healthy (a leader, no alarm), else 0", labels=["member"])
        leader = GaugeMetricFamily("pgcarve_etcd_member_leader", "1 for the etcd member the others follow as leader",
                                   labels=["member"])
        quorum = GaugeMetricFamily("pgcarve_etcd_has_quorum", "1 if more than half of etcd's members are up and "
                                   "follow a leader that is up (writes to etcd succeed), else 0")
        members = GaugeMetricFamily("pgcarve_etcd_members", "etcd's members, as the cluster last listed them")
        polled = GaugeMetricFamily("pgcarve_etcd_last_poll_timestamp_seconds",
                                   "When the manager last polled etcd (Unix time)")
        if health is not None:
            for member in health.members:
                up.add_metric([member.name], 1.0 if member.up else 0.0)
                leader.add_metric([member.name], 1.0 if member.leader else 0.0)
            quorum.add_metric([], 1.0 if health.has_quorum else 0.0)
            if health.members_known:
                members.add_metric([], float(len(health.members)))
            polled.add_metric([], health.at)
        elif self.watch.error is not None:  # our own TLS files are unusable: nothing can be written either
            quorum.add_metric([], 0.0)
        yield up
        yield leader
        yield quorum
        yield members
        yield polled
