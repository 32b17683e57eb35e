"""Patroni as etcd shows it, in /metrics (replication.roles: patroni): each instance's leader,
synchronous standbys, timeline and members, as Patroni's keys said at the manager's last listing
(every couple of seconds); never read from etcd at scrape time. monitoring/prometheus/
pgcarve-rules.yml alerts on these (PgcarvePatroniNoLeader, PgcarvePatroniNoSynchronousStandby,
PgcarvePatroniMemberNotRunning)."""

from __future__ import annotations

from collections.abc import Iterator

from pgcarve.control.patroni_roles import PatroniClusters, guest_of_member
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

RUNNING = ("running", "streaming")


class PatroniMetrics(Collector):
    def __init__(self, clusters: PatroniClusters):
        self.clusters = clusters

    def collect(self) -> Iterator[GaugeMetricFamily]:
        views, read_at = self.clusters.last_read()
        has_leader = GaugeMetricFamily("pgcarve_patroni_has_leader", "1 if a member of the instance holds its "
                                       "leader key in etcd, else 0", labels=["instance"])
        leader = GaugeMetricFamily("pgcarve_patroni_leader", "1 for the guest holding the instance's leader key",
                                   labels=["instance", "guest"])
        synchronous = GaugeMetricFamily("pgcarve_patroni_synchronous_standby", "1 for each guest Patroni has made "
                                        "a synchronous standby of the instance", labels=["instance", "guest"])
        synchronous_count = GaugeMetricFamily("pgcarve_patroni_synchronous_standbys", "how many synchronous "
                                              "standbys Patroni names for the instance", labels=["instance"])
        running = GaugeMetricFamily("pgcarve_patroni_member_running", "1 if the member's Patroni reports its "
                                    "PostgreSQL running (streaming, for a replica), else 0",
                                    labels=["instance", "guest", "role"])
        timeline = GaugeMetricFamily("pgcarve_patroni_timeline", "the leader's timeline (grows with each failover "
                                     "or switchover)", labels=["instance"])
        synchronous_mode = GaugeMetricFamily("pgcarve_patroni_synchronous_mode", "1 if Patroni keeps synchronous "
                                             "standbys for the instance (strict: commits wait without one), else 0",
                                             labels=["instance"])
        paused = GaugeMetricFamily("pgcarve_patroni_paused", "1 if Patroni's automatic failover is paused for the "
                                   "instance", labels=["instance"])
        if read_at is not None:
            for name, view in sorted(views.items()):
                if not view.leader and not view.members:
                    # Keys with no member behind them: a retired instance's, kept for its return
                    # (control/retirement.py). An instance whose guests are all down has no member
                    # either; PgcarveInstanceDown reports that one.
                    continue
                has_leader.add_metric([name], 1.0 if view.leader else 0.0)
                if view.leader:
                    leader.add_metric([name, guest_of_member(view.leader)], 1.0)
                for member in view.synchronous_standbys:
                    synchronous.add_metric([name, guest_of_member(member)], 1.0)
                synchronous_count.add_metric([name], float(len(view.synchronous_standbys)))
                for m in view.members:
                    up = m.state in RUNNING and (m.role == "primary" or m.replication_state in (None, "streaming"))
                    running.add_metric([name, guest_of_member(m.name), m.role], 1.0 if up else 0.0)
                if view.timeline is not None:
                    timeline.add_metric([name], float(view.timeline))
                paused.add_metric([name], 1.0 if view.paused else 0.0)
                on = view.settings is not None and view.settings.synchronous_mode != "off"
                synchronous_mode.add_metric([name], 1.0 if on else 0.0)
        yield has_leader
        yield leader
        yield synchronous
        yield synchronous_count
        yield running
        yield timeline
        yield synchronous_mode
        yield paused
