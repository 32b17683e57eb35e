"""The experiment's cases on fresh guests: carved, single, multi-instance, no-replica (and the
older multi-process approximation). A case is a fleet of its own (its own fleet name, so it never
touches an operator's guests), made through the Scaler, loaded with the insert-only pgbench of
../shared/seeds, and removed again."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pgcarve.advice.clusters import cluster_port, wait_clusters
from pgcarve.advice.load import LoadTarget, apply_settings, run_load
from pgcarve.config import FleetConfig
from pgcarve.control.fleet import Fleet, Progress, no_progress
from pgcarve.control.removal import remove_instance
from pgcarve.control.scaler import Scaler
from pgcarve.errors import PgcarveError
from pgcarve.postgres.pgbench import INSERT_SCRIPT, create_test_table, insert_script
from pgcarve.postgres.session import CLIENT_DATABASE
from pgcarve.settings import Paths

Say = Callable[[str], None]

CARVED, SINGLE, MULTI_INSTANCE, NO_REPLICA, MULTI_PROCESS = (
    "carved", "single", "multi-instance", "no-replica", "multi-process")
CASE_DOC = {
    CARVED: "N instances (N guests of V vCPUs), one primary per guest, each with its synchronous standby(s) "
            "on other hosts; clients split evenly over the N primaries",
    SINGLE: "one instance whose guest has N x V vCPUs, with its synchronous standby(s); all clients on it",
    MULTI_INSTANCE: "N PostgreSQL clusters (Debian's pg_createcluster, ports 5432..) in one guest of N x V "
                    "vCPUs - one kernel, as the experiment's four primaries on one host - each with its own "
                    "synchronous standby cluster in the standby guests; clients split evenly over the N clusters",
    MULTI_PROCESS: "APPROXIMATION: N concurrent pgbench runs, each on its own table, against the single "
                   "instance's one primary (one postmaster, one WAL stream, one walsender) - not N PostgreSQL "
                   "clusters in one kernel as in the experiment (that is multi-instance)",
    NO_REPLICA: "one instance with N x V vCPUs, replication.standbys 0 and synchronous_commit = local",
}


@dataclass(frozen=True)
class LoadParams:
    """How every case is loaded."""

    clients: int  # total pgbench clients of a case
    threads: int  # total pgbench threads of a case
    seconds: int
    sampling_rate: float = 1.0  # of pgbench's per-transaction log
    clients_per_target: bool = False  # False: `clients` split over the targets; True: each target gets them all
    pg_settings: Mapping[str, str] = field(default_factory=dict)

    def per_target(self, total: int, targets: int) -> int:
        return total if self.clients_per_target else max(1, total // max(1, targets))


def case_fleet(prefix: str, kind: str) -> str:
    """A fleet name of its own for each group of guests, new on every run: prefix + kind + 4 hex.

    Guest MACs derive from fleet and guest name, and libvirt keeps a DHCP lease per (MAC, client
    id); a guest re-created under the same name gets a new lease while the old one is still listed,
    and LibvirtHost.guest_address takes the first one, which can be the stale address. Fresh
    names give fresh MACs, so a case never re-creates a name.
    """
    return f"{prefix}{kind}{os.urandom(2).hex()}"


def with_size(config: FleetConfig, vcpus: int | None = None, standbys: int | None = None,
              synchronous_commit: str | None = None, memory_mib: int | None = None,
              fleet: str | None = None, clusters: int | None = None) -> FleetConfig:
    """The same hosts with another instance size, PostgreSQL clusters per guest, replication or fleet name."""
    instance = config.instance.model_copy(update={k: v for k, v in (("vcpus", vcpus), ("memory_mib", memory_mib),
                                                                    ("clusters", clusters)) if v is not None})
    repl_update: dict[str, Any] = {}
    if standbys is not None:
        repl_update["standbys"] = standbys
        if standbys:
            repl_update["sync_count"] = min(config.replication.sync_count, standbys)
    if synchronous_commit is not None:
        repl_update["synchronous_commit"] = synchronous_commit
    # A case's fleet is measured for minutes and thrown away: who would fail it over does not change
    # its throughput, while Patroni's bootstrap adds minutes to every boot under emulation (and runs
    # one cluster per guest, where the multi-instance case needs several). The manager's roles, then.
    repl_update["roles"] = "manager"
    replication = config.replication.model_copy(update=repl_update)
    # No backup section: a case's guests are thrown away after their run, and archiving their WAL
    # would both load the guests being measured and leave a stanza per case in the repository.
    return FleetConfig.model_validate({**config.model_dump(mode="json"), "instance": instance.model_dump(),
                                       "replication": replication.model_dump(),
                                       "fleet": fleet or config.fleet, "backup": None})


def remove_all(fleet: Fleet) -> None:
    """Remove every guest of a case's fleet (no fencing: its data is thrown away)."""
    for inst in fleet.observe(with_endpoints=False):
        with contextlib.suppress(PgcarveError):
            remove_instance(fleet, inst)


@contextlib.contextmanager
def instances_up(config: FleetConfig, paths: Paths, count: int, record: dict[str, Any],
                 progress: Progress = no_progress, boot_timeout_s: float = 600.0) -> Iterator[Fleet]:
    """`count` fresh instances of `config` through Scaler.scale, removed again afterwards."""
    fleet = Fleet(config, paths, boot_timeout_s=boot_timeout_s)
    try:
        remove_all(fleet)
        t = time.monotonic()
        Scaler(fleet).scale(count, progress)
        record["boot_s"] = round(time.monotonic() - t, 1)
        yield fleet
    finally:
        with contextlib.suppress(Exception):
            remove_all(fleet)
        fleet.close()


def run_case(case: str, fleet: Fleet, instances: int, params: LoadParams, settings: Mapping[str, str],
             logdir: Path, say: Say = lambda _m: None) -> dict[str, Any]:
    """Load one case's fleet (already up) for params.seconds; its figures as a dict."""
    found = [inst for inst in fleet.observe() if inst.primary and inst.primary.endpoint]
    primaries = [inst.primary for inst in found if inst.primary]
    if not primaries:
        raise PgcarveError(f"{case}: no reachable primary")
    extra: dict[str, Any] = {}
    # Where settings go: every primary, or (multi-instance) every cluster of the one primary guest.
    configured = {g.name: g for g in primaries}

    def clients_jobs(targets: int) -> tuple[int, int]:
        clients = params.per_target(params.clients, targets)
        return clients, min(params.per_target(params.threads, targets), clients)

    if case == MULTI_INSTANCE:
        t = time.monotonic()
        clusters = wait_clusters(fleet, primaries[0], instances, [s.name for s in found[0].standbys],
                                 fleet.boot_timeout_s, lambda m: say(f"  {m}"))
        extra = {"clusters": instances, "clusters_ready_s": round(time.monotonic() - t, 1)}  # after "instance ready"
        configured = {f"{g.name}:{cluster_port(k)}": g for k, g in enumerate(clusters, start=1)}
        targets = [LoadTarget(g, f"{case}-{g.name}-port{cluster_port(k)}", INSERT_SCRIPT, *clients_jobs(instances))
                   for k, g in enumerate(clusters, start=1)]
    elif case == MULTI_PROCESS:
        guest = primaries[0]
        tables = [f"test{k}" for k in range(1, instances + 1)]
        with fleet.connect(guest, database=CLIENT_DATABASE) as conn:
            for table in tables:
                create_test_table(conn, table)
        targets = [LoadTarget(guest, f"{case}-table{k}", insert_script(table), *clients_jobs(instances))
                   for k, table in enumerate(tables, start=1)]
    elif case == CARVED:
        targets = [LoadTarget(g, f"{case}-{g.name}", INSERT_SCRIPT, *clients_jobs(len(primaries)))
                   for g in primaries]
    else:
        targets = [LoadTarget(primaries[0], f"{case}-{primaries[0].name}", INSERT_SCRIPT, params.clients,
                              min(params.threads, params.clients))]
    conf = {key: apply_settings(fleet, g, settings) for key, g in configured.items()}
    say(f"{case}: pgbench on {len(targets)} target(s), {params.seconds} s")
    # The experiment profiled its single instance: the one case where one kernel's locks show.
    result = run_load(fleet, targets, params.seconds, params.sampling_rate, logdir, profile_kernel=case == SINGLE)
    result.update({
        "case": case,
        "how": CASE_DOC[case],
        "approximation": case == MULTI_PROCESS,
        "script": targets[0].script.strip() if case != MULTI_PROCESS else insert_script("testK").strip(),
        "postgresql_conf": conf,
        "guests": {g.name: {"host": g.info.host, "vcpus": len(g.info.vcpu_pins),
                            "host_cpus": list(g.host_cpus), "memory_mib": g.info.memory_mib} for g in primaries},
        "standbys": fleet.config.replication.standbys,
        **extra,
    })
    say(f"{case}: {result['aggregate_tps']} TPS, p50 {result['latency_p50_ms']} ms, "
        f"p99 {result['latency_p99_ms']} ms")
    return result


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's runs as one result: the run nearest the median TPS stands for the case (its
    latencies, CPU and settings), its aggregate_tps is the median, and every run's TPS is kept
    in run order with the range and spread (max - min over the median)."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[-1]
    tps = [r["aggregate_tps"] for r in good]
    median = statistics.median(tps)
    typical = min(good, key=lambda r: abs(r["aggregate_tps"] - median))
    return {**typical, "aggregate_tps": round(median, 1), "runs_tps": tps, "tps_min": min(tps),
            "tps_max": max(tps), "spread": round((max(tps) - min(tps)) / median, 3) if median else None,
            "repeats": len(good), "failed_runs": [r["error"] for r in runs if "error" in r]}
