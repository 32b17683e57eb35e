"""Prometheus exposition of what the manager knows, read at scrape time.

Counters per instance (rate() gives TPS/QPS), gauges for placement, replication, hosts and the
collector, and counters of scale operations and incidents. Names follow Prometheus conventions:
base units (`_bytes`, `_seconds`), `_total` counters, `_timestamp_seconds` for Unix times.
monitoring/ holds the recording rules, alerts and Grafana dashboard built on these series;
tests/monitoring checks the exposition with `promtool check metrics`.

pgcarve's own `instance` label names a pgcarve instance, so Prometheus must scrape with
`honor_labels: true` (monitoring/prometheus/prometheus.example.yml).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from pgcarve.control.collector import Target
from pgcarve.control.patroni_roles import PatroniClusters
from pgcarve.control.rates import Sample
from pgcarve.control.service import ManagerService
from pgcarve.dcs.watch import EtcdWatch
from pgcarve.errors import PgcarveError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from pgcarve_api.etcd_metrics import EtcdMetrics
from pgcarve_api.patroni_metrics import PatroniMetrics

Family = CounterMetricFamily | GaugeMetricFamily

# Label values always exported (zero when nothing happened), so alerts and increase() see the
# first occurrence as a change from 0 rather than a series appearing out of nowhere.
SYNC_STATES = ("sync", "potential", "quorum", "async")
OPERATION_RESULTS = ("succeeded", "failed", "superseded")
OPERATION_STATUSES = ("pending", "running")
INCIDENT_ENDINGS = (("restart", "recovered"), ("failover", "recovered"), ("rebuild", "recovered"),
                    ("none", "recovered"), ("restart", "failed"), ("failover", "failed"), ("none", "reported"))
OPEN_STATUSES = ("recovering", "failed")
ENDED_STATUSES = ("recovered", "failed", "reported")


class IncidentFacts(Protocol):
    """What the metrics read of a supervisor incident (pgcarve.control.supervisor.Incident)."""

    id: int
    instance: str
    what: str
    detected_at: float
    status: str
    action: str
    finished_at: float | None


@dataclass(frozen=True)
class _Ending:
    status: str
    finished_at: float | None


class IncidentEndings:
    """Counts incidents as they end, by what was done (action) and how it ended (status).

    The supervisor keeps the incidents themselves (the last 500), not counts by outcome; this
    counts each ending once, as seen at scrape time. A repair that failed and is tried again
    counts again when that attempt ends (each ending stamps a new `finished_at`).
    """

    def __init__(self) -> None:
        self._seen: dict[int, _Ending] = {}
        self.counts: dict[tuple[str, str], int] = dict.fromkeys(INCIDENT_ENDINGS, 0)
        self._lock = threading.Lock()

    def update(self, incidents: Iterable[IncidentFacts]) -> dict[tuple[str, str], int]:
        with self._lock:
            current: dict[int, _Ending] = {}
            for incident in incidents:
                if incident.status not in ENDED_STATUSES:
                    continue
                ending = _Ending(incident.status, incident.finished_at)
                current[incident.id] = ending
                if self._seen.get(incident.id) != ending:
                    key = (incident.action or "none", incident.status)
                    self.counts[key] = self.counts.get(key, 0) + 1
            self._seen = current
            return dict(self.counts)


class FleetMetrics(Collector):
    def __init__(self, service: ManagerService):
        self.service = service
        self._latest: dict[str, tuple[str, Sample]] = {}
        self._lock = threading.Lock()
        self._endings = IncidentEndings()
        if service.collector is not None:
            service.collector.on_sample.append(self.on_sample)

    def on_sample(self, target: Target, sample: Sample) -> None:
        with self._lock:
            self._latest[target.instance] = (target.host, sample)

    def collect(self) -> Iterator[Family]:
        yield from self._throughput()
        yield from self._instances()
        yield from self._replication()
        yield from self._hosts()
        yield from self._operations()
        yield from self._incidents()

    # -- throughput and the collector ---------------------------------------------------------

    def _throughput(self) -> Iterator[Family]:
        live = {inst.name for inst in self.service.view.instances}
        with self._lock:
            for gone in set(self._latest) - live:
                del self._latest[gone]
            latest = dict(self._latest)
        # Raw: everything PostgreSQL counted (the collector's own statements excluded). Client:
        # what clients did, without autovacuum and pgcarve's own sessions (collector.py says how).
        xacts = CounterMetricFamily("pgcarve_xact", "Transactions (commit + rollback) PostgreSQL counted on the "
                                    "instance's primary, all databases, background work included; the collector's "
                                    "own excluded", labels=["instance", "host"])
        calls = CounterMetricFamily("pgcarve_statements", "Statements PostgreSQL counted (pg_stat_statements calls), "
                                    "all databases; the collector's own excluded", labels=["instance", "host"])
        client_xacts = CounterMetricFamily("pgcarve_client_xact", "Transactions (commit + rollback) clients ran "
                                           "on the instance's primary: autovacuum and pgcarve's own sessions excluded",
                                           labels=["instance", "host"])
        client_calls = CounterMetricFamily("pgcarve_client_statements", "Statements clients executed "
                                           "(pg_stat_statements calls): pgcarve's own sessions excluded",
                                           labels=["instance", "host"])
        background = CounterMetricFamily("pgcarve_background_xact", "Transactions PostgreSQL counted that were not "
                                         "clients' (autovacuum, pgcarve's own sessions): pgcarve_xact_total minus "
                                         "pgcarve_client_xact_total", labels=["instance", "host"])
        polled = GaugeMetricFamily("pgcarve_collector_last_success_timestamp_seconds",
                                   "When the collector last read the instance's counters (Unix time)",
                                   labels=["instance", "host"])
        for name, (host, sample) in sorted(latest.items()):
            all_xacts = sample.xacts if sample.all_xacts is None else sample.all_xacts
            xacts.add_metric([name, host], float(all_xacts))
            client_xacts.add_metric([name, host], float(sample.xacts))
            background.add_metric([name, host], float(max(0, all_xacts - sample.xacts)))
            all_calls = sample.calls if sample.all_calls is None else sample.all_calls
            if all_calls is not None:
                calls.add_metric([name, host], float(all_calls))
            if sample.calls is not None:
                client_calls.add_metric([name, host], float(sample.calls))
            polled.add_metric([name, host], sample.wall)
        yield xacts
        yield calls
        yield client_xacts
        yield client_calls
        yield background
        yield polled

        snap = self.service.snapshot()
        yield GaugeMetricFamily("pgcarve_aggregate_tps", "Sum of the primaries' client TPS over the last poll "
                                "(the manager's 1-second view; dashboards use the recording rules)",
                                value=snap.aggregate_tps)
        collector = self.service.collector
        rounds = GaugeMetricFamily("pgcarve_collector_last_round_timestamp_seconds",
                                   "When the collector last finished a poll round over every instance (Unix time)")
        if collector is not None:
            # The newest recorded snapshot only: history(0) walks back no further.
            last = self.service.tracker.history(0)
            if last:
                rounds.add_metric([], last[-1].at)
        yield rounds

    # -- instances ------------------------------------------------------------------------------

    def _instances(self) -> Iterator[Family]:
        instances = self.service.view.instances
        collector = self.service.collector
        errors = collector.last_errors() if collector is not None else {}
        yield GaugeMetricFamily("pgcarve_instances", "Instances in the fleet", value=len(instances))
        up = GaugeMetricFamily("pgcarve_instance_up", "1 if the instance's primary guest is running, "
                               "0 if it is stopped, paused or missing", labels=["instance", "host"])
        vcpus = GaugeMetricFamily("pgcarve_instance_vcpus", "vCPUs of the instance's primary",
                                  labels=["instance", "host"])
        pinned = GaugeMetricFamily("pgcarve_instance_pinned_cpu", "1 for each host CPU a primary's vCPU is pinned to",
                                   labels=["instance", "host", "cpu"])
        poll_error = GaugeMetricFamily("pgcarve_collector_poll_error",
                                       "1 while the collector cannot read the running primary's statistics "
                                       "(PostgreSQL not answering); the reason is in the manager's log",
                                       labels=["instance", "host"])
        waiting = GaugeMetricFamily("pgcarve_instance_commits_waiting",
                                    "Sessions whose commit has waited over 3 s for a synchronous standby",
                                    labels=["instance", "host"])
        for inst in instances:
            primary = inst.primary
            if primary is None:
                up.add_metric([inst.name, ""], 0.0)
                continue
            host = primary.info.host
            running = primary.info.state == "running"
            up.add_metric([inst.name, host], 1.0 if running else 0.0)
            vcpus.add_metric([inst.name, host], float(len(primary.info.vcpu_pins)))
            for cpu in primary.host_cpus:
                pinned.add_metric([inst.name, host, str(cpu)], 1.0)
            # A primary still being built by a scale operation is not polled as a fault.
            if collector is not None and running and not primary.info.creating:
                poll_error.add_metric([inst.name, host], 1.0 if inst.name in errors else 0.0)
                waiting.add_metric([inst.name, host], float(collector.commits_waiting(inst.name)))
        yield up
        yield vcpus
        yield pinned
        yield poll_error
        yield waiting

    # -- replication ----------------------------------------------------------------------------

    def _replication(self) -> Iterator[Family]:
        replication = self.service.config.replication
        yield GaugeMetricFamily("pgcarve_replication_standbys_configured", "Standbys each primary should have "
                                "(replication.standbys)", value=replication.standbys)
        yield GaugeMetricFamily("pgcarve_replication_sync_standbys_required",
                                "Standbys that must confirm each commit (replication.sync_count; 0 without standbys)",
                                value=replication.sync_count if replication.standbys else 0)
        lag = GaugeMetricFamily("pgcarve_standby_replay_lag_bytes", "WAL bytes a standby has not replayed yet",
                                labels=["instance", "standby", "sync_state"])
        streaming = GaugeMetricFamily("pgcarve_instance_streaming_standbys",
                                      "Standbys streaming from the instance's primary, by pg_stat_replication "
                                      "sync_state", labels=["instance", "sync_state"])
        collector = self.service.collector
        if collector is not None:
            errors = collector.last_errors()
            for inst in self.service.view.instances:
                primary = inst.primary
                # Rows from a poll that no longer succeeds are the past: leave them out.
                if primary is None or primary.info.state != "running" or inst.name in errors:
                    continue
                rows = self.service.replication(inst.name)
                counts = dict.fromkeys(SYNC_STATES, 0)
                for row in rows:
                    if row.lag_bytes is not None:
                        lag.add_metric([inst.name, row.application_name, row.sync_state or ""], float(row.lag_bytes))
                    if row.state == "streaming" and row.sync_state:
                        counts[row.sync_state] = counts.get(row.sync_state, 0) + 1
                for state, count in counts.items():
                    streaming.add_metric([inst.name, state], float(count))
        yield lag
        yield streaming

    # -- hosts and the fleet view ---------------------------------------------------------------

    def _hosts(self) -> Iterator[Family]:
        view = self.service.view
        observed = GaugeMetricFamily("pgcarve_fleet_observed_timestamp_seconds",
                                     "When the manager last listed every host's guests successfully (Unix time)")
        if view.observed_at > 0:
            observed.add_metric([], view.observed_at)
        yield observed
        connected = GaugeMetricFamily("pgcarve_host_events_connected",
                                      "1 while the manager is subscribed to the host's libvirt lifecycle events "
                                      "(its libvirtd answers), 0 while it tries to reconnect", labels=["host"])
        supervisor = self.service.supervisor
        if supervisor is not None:
            for host in self.service.config.hosts:
                connected.add_metric([host.name], 1.0 if supervisor.watching(host.name) else 0.0)
        yield connected
        cpus = GaugeMetricFamily("pgcarve_host_cpus", "CPUs of the host", labels=["host", "role"])
        pinned = GaugeMetricFamily("pgcarve_host_pinned_cpus", "Host CPUs given to guests' vCPUs "
                                   "(primaries and standbys)", labels=["host"])
        guests = GaugeMetricFamily("pgcarve_host_guests", "pgcarve guests on the host", labels=["host"])
        try:
            hosts = self.service.hosts()
        except PgcarveError:
            hosts = []  # a host's topology could not be read: its gauges are left out, events say why
        for doc in hosts:
            name = str(doc["name"])
            cpus.add_metric([name, str(doc["role"])], float(doc["cpus"]))
            pinned.add_metric([name], float(doc["cpus"]) - float(doc["free_cpus"]))
            guests.add_metric([name], float(doc["instances"]))
        yield cpus
        yield pinned
        yield guests

    # -- operations and incidents ---------------------------------------------------------------

    def _operations(self) -> Iterator[Family]:
        queue = self.service.operations
        counts = dict(queue.counts)
        yield CounterMetricFamily("pgcarve_operations_accepted", "Scale requests accepted (PUT /v1/scale)",
                                  value=float(counts.get("accepted", 0)))
        ended = CounterMetricFamily("pgcarve_operations", "Scale operations that ended, by result "
                                    "(superseded: a newer request came before it started)", labels=["result"])
        for result in OPERATION_RESULTS:
            ended.add_metric([result], float(counts.get(result, 0)))
        yield ended
        active = GaugeMetricFamily("pgcarve_operations_active", "Scale operations waiting or running",
                                   labels=["status"])
        statuses: list[str] = [op.status for op in queue.active()]
        for status in OPERATION_STATUSES:
            active.add_metric([status], float(statuses.count(status)))
        yield active

    def _incidents(self) -> Iterator[Family]:
        supervisor = self.service.supervisor
        incidents = self.service.incidents()
        detected = CounterMetricFamily("pgcarve_incidents", "Faults detected (guest stopped, paused, missing), "
                                       "by what happened", labels=["what"])
        ended = CounterMetricFamily("pgcarve_incidents_ended", "Incidents whose repair ended, by what pgcarve did "
                                    "(restart, failover, rebuild, none) and how it ended (recovered, failed, "
                                    "reported)", labels=["action", "status"])
        if supervisor is not None:
            for what, count in sorted(dict(supervisor.counts).items()):
                detected.add_metric([what], float(count))
            for (action, status), count in sorted(self._endings.update(incidents).items()):
                ended.add_metric([action, status], float(count))
        yield detected
        yield ended

        open_count = GaugeMetricFamily("pgcarve_incidents_open", "Faults not recovered yet (being repaired, "
                                       "or the repair failed and will be tried again)", labels=["instance"])
        open_since = GaugeMetricFamily("pgcarve_incident_open_since_timestamp_seconds",
                                       "When the oldest fault of this kind still open on the instance was detected "
                                       "(Unix time)", labels=["instance", "what"])
        failover = GaugeMetricFamily("pgcarve_instance_last_failover_timestamp_seconds",
                                     "When the instance last finished failing over to a standby (Unix time)",
                                     labels=["instance"])
        if supervisor is not None:
            per_instance = dict.fromkeys((inst.name for inst in self.service.view.instances), 0)
            oldest: dict[tuple[str, str], float] = {}
            last_failover: dict[str, float] = {}
            for incident in incidents:
                if incident.status in OPEN_STATUSES:
                    per_instance[incident.instance] = per_instance.get(incident.instance, 0) + 1
                    key = (incident.instance, incident.what)
                    oldest[key] = min(oldest.get(key, incident.detected_at), incident.detected_at)
                elif (incident.status == "recovered" and incident.action == "failover"
                      and incident.finished_at is not None):
                    at = max(last_failover.get(incident.instance, 0.0), incident.finished_at)
                    last_failover[incident.instance] = at
            for name, count in sorted(per_instance.items()):
                open_count.add_metric([name], float(count))
            for (name, what), at in sorted(oldest.items()):
                open_since.add_metric([name, what], at)
            for name, at in sorted(last_failover.items()):
                failover.add_metric([name], at)
        yield open_count
        yield open_since
        yield failover


def build_registry(service: ManagerService, etcd: EtcdWatch | None = None,
                   patroni: PatroniClusters | None = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(FleetMetrics(service))
    if etcd is not None:
        registry.register(EtcdMetrics(etcd))
    if patroni is not None:
        registry.register(PatroniMetrics(patroni))
    return registry
