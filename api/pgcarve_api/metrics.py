"""Prometheus exposition: raw counters per instance (so rate() gives TPS), gauges for lag and
pinning, and the manager's own operation counters. Values are read at scrape time."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from pgcarve.collector import Target
from pgcarve.rates import Sample
from pgcarve.service import ManagerService
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


class FleetMetrics(Collector):
    def __init__(self, service: ManagerService):
        self.service = service
        self._latest: dict[str, tuple[str, Sample]] = {}
        self._lock = threading.Lock()
        if service.collector is not None:
            service.collector.on_sample.append(self.on_sample)

    def on_sample(self, target: Target, sample: Sample) -> None:
        with self._lock:
            self._latest[target.instance] = (target.host, sample)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        live = {inst.name for inst in self.service.view.instances}
        with self._lock:
            for gone in set(self._latest) - live:
                del self._latest[gone]
            latest = dict(self._latest)
        xacts = CounterMetricFamily("pgcarve_xact", "Transactions (commit + rollback) on the instance's primary, "
                                    "the collector's own excluded", labels=["instance", "host"])
        calls = CounterMetricFamily("pgcarve_statements", "Statements executed (pg_stat_statements calls), "
                                    "the collector's own excluded", labels=["instance", "host"])
        # Placeholders (the lead replaces the values): what clients did, background work subtracted.
        client_xacts = CounterMetricFamily("pgcarve_client_xact", "Transactions (commit + rollback) clients ran "
                                           "on the instance's primary, background work excluded",
                                           labels=["instance", "host"])
        client_calls = CounterMetricFamily("pgcarve_client_statements", "Statements clients executed "
                                           "(pg_stat_statements calls), background work excluded",
                                           labels=["instance", "host"])
        for name, (host, sample) in sorted(latest.items()):
            xacts.add_metric([name, host], float(sample.xacts))
            client_xacts.add_metric([name, host], float(sample.xacts))
            if sample.calls is not None:
                calls.add_metric([name, host], float(sample.calls))
                client_calls.add_metric([name, host], float(sample.calls))
        yield xacts
        yield calls
        yield client_xacts
        yield client_calls

        lag = GaugeMetricFamily("pgcarve_standby_replay_lag_bytes", "WAL bytes a standby has not replayed yet",
                                labels=["instance", "standby", "sync_state"])
        vcpus = GaugeMetricFamily("pgcarve_instance_vcpus", "vCPUs of the instance's primary",
                                  labels=["instance", "host"])
        pinned = GaugeMetricFamily("pgcarve_instance_pinned_cpu", "1 for each host CPU a primary's vCPU is pinned to",
                                   labels=["instance", "host", "cpu"])
        up = GaugeMetricFamily("pgcarve_instance_up", "1 if the primary's guest is running",
                               labels=["instance", "host"])
        for inst in self.service.view.instances:
            for row in self.service.replication(inst.name):
                if row.lag_bytes is not None:
                    lag.add_metric([inst.name, row.application_name, row.sync_state or ""], float(row.lag_bytes))
            if inst.primary is not None:
                host = inst.primary.info.host
                vcpus.add_metric([inst.name, host], float(len(inst.primary.info.vcpu_pins)))
                for cpu in inst.primary.host_cpus:
                    pinned.add_metric([inst.name, host, str(cpu)], 1.0)
                up.add_metric([inst.name, host], 1.0 if inst.primary.info.state == "running" else 0.0)
        yield lag
        yield vcpus
        yield pinned
        yield up

        snap = self.service.snapshot()
        yield GaugeMetricFamily("pgcarve_aggregate_tps", "Sum of the primaries' TPS over the last poll",
                                value=snap.aggregate_tps)
        yield GaugeMetricFamily("pgcarve_instances", "Instances in the fleet", value=len(self.service.view.instances))
        ops = CounterMetricFamily("pgcarve_operations", "Scale operations by outcome", labels=["result"])
        for result, count in sorted(self.service.operations.counts.items()):
            ops.add_metric([result], float(count))
        yield ops
        faults = CounterMetricFamily("pgcarve_incidents", "Faults detected (guest stopped, paused, missing)",
                                     labels=["what"])
        if self.service.supervisor is not None:
            for what, count in sorted(self.service.supervisor.counts.items()):
                faults.add_metric([what], float(count))
        yield faults
        open_ = GaugeMetricFamily("pgcarve_incidents_open", "Faults not recovered yet", labels=["instance"])
        for incident in self.service.incidents():
            if incident.status in ("recovering", "failed"):
                open_.add_metric([incident.instance], 1.0)
        yield open_


def build_registry(service: ManagerService) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(FleetMetrics(service))
    return registry
