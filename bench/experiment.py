"""The experiment's cases (boot guests): carved, single, multi-instance, no-replica (and the older
multi-process approximation) on fresh guests, the insert-only pgbench load of ../shared/seeds on
each, repeated and interleaved (every case once per round, the order rotated each round), and a
verdict that knows its noise. Writes experiment.json (and .png)."""

from __future__ import annotations

import contextlib
import glob
import json
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgcarve.config import FleetConfig
from pgcarve.control.fleet import Fleet
from pgcarve.control.scaler import Scaler
from pgcarve.errors import PgcarveError
from pgcarve.guest.image import LocalImage
from pgcarve.postgres.pgbench import INSERT_SCRIPT, create_test_table, insert_script, pgbench_path
from pgcarve.postgres.session import CLIENT_DATABASE
from pgcarve.settings import Paths

from bench.charts import chart_experiment, save_chart
from bench.clusters import cluster_port, wait_clusters
from bench.guests import guest_hosts, prepare_hosts, progress_logger, remove_all, with_size
from bench.harness import bench_fleet, finish, log, run_meta, write_json
from bench.load import LoadTarget, apply_settings, guest_facts, run_load


def _split(total: int, parts: int) -> int:
    return max(1, total // max(1, parts))


@dataclass(frozen=True)
class ExperimentParams:
    instances: int
    standbys: int
    clients: int
    threads: int
    seconds: int
    sampling_rate: float
    pg_settings: dict[str, str]
    memory_mib: int | None = None
    vcpus: int | None = None  # V, vCPUs per carved guest; None = 1 in the sandbox, the hosts file's on real hosts
    clients_per_target: bool = False  # False: `clients` split over the targets; True: each target gets them all
    # Runs of every case, interleaved: below MIN_REPEATS the verdict is always inconclusive.
    repeats: int = 3

    def per_target(self, total: int, targets: int) -> int:
        return total if self.clients_per_target else _split(total, targets)


CASE_DOC = {
    "carved": "N instances (N guests of V vCPUs), one primary per guest, each with its synchronous standby(s) "
              "on other hosts; clients split evenly over the N primaries",
    "single": "one instance whose guest has N x V vCPUs, with its synchronous standby(s); all clients on it",
    "multi-instance": "N PostgreSQL clusters (Debian's pg_createcluster, ports 5432..) in one guest of N x V "
                      "vCPUs - one kernel, as the experiment's four primaries on one host - each with its own "
                      "synchronous standby cluster in the standby guests; clients split evenly over the N clusters",
    "multi-process": "APPROXIMATION: N concurrent pgbench runs, each on its own table, against the single "
                     "instance's one primary (one postmaster, one WAL stream, one walsender) - not N PostgreSQL "
                     "clusters in one kernel as in the experiment (that is multi-instance)",
    "no-replica": "one instance with N x V vCPUs, replication.standbys 0 and synchronous_commit = local",
}


def run_case(case: str, fleet: Fleet, params: ExperimentParams, settings: dict[str, str],
             logdir: Path) -> dict[str, Any]:
    instances = [inst for inst in fleet.observe() if inst.primary and inst.primary.endpoint]
    primaries = [inst.primary for inst in instances if inst.primary]
    if not primaries:
        raise PgcarveError(f"{case}: no reachable primary")
    n = params.instances
    extra: dict[str, Any] = {}
    # Where settings go: every primary, or (multi-instance) every cluster of the one primary guest.
    configured = {g.name: g for g in primaries}

    def clients_jobs(targets: int) -> tuple[int, int]:
        clients = params.per_target(params.clients, targets)
        return clients, min(params.per_target(params.threads, targets), clients)

    if case == "multi-instance":
        t = time.monotonic()
        clusters = wait_clusters(fleet, primaries[0], n, [s.name for s in instances[0].standbys],
                                 fleet.boot_timeout_s, lambda m: log(f"  {m}"))
        extra = {"clusters": n, "clusters_ready_s": round(time.monotonic() - t, 1)}  # after "instance ready"
        configured = {f"{g.name}:{cluster_port(k)}": g for k, g in enumerate(clusters, start=1)}
        targets = [LoadTarget(g, f"{case}-{g.name}-port{cluster_port(k)}", INSERT_SCRIPT, *clients_jobs(n))
                   for k, g in enumerate(clusters, start=1)]
    elif case == "multi-process":
        guest = primaries[0]
        tables = [f"test{k}" for k in range(1, n + 1)]
        with fleet.connect(guest, database=CLIENT_DATABASE) as conn:
            for table in tables:
                create_test_table(conn, table)
        targets = [LoadTarget(guest, f"{case}-table{k}", insert_script(table), *clients_jobs(n))
                   for k, table in enumerate(tables, start=1)]
    elif case == "carved":
        targets = [LoadTarget(g, f"{case}-{g.name}", INSERT_SCRIPT, *clients_jobs(len(primaries)))
                   for g in primaries]
    else:
        targets = [LoadTarget(primaries[0], f"{case}-{primaries[0].name}", INSERT_SCRIPT, params.clients,
                              min(params.threads, params.clients))]
    conf = {key: apply_settings(fleet, g, settings) for key, g in configured.items()}
    log(f"{case}: pgbench on {len(targets)} target(s), {params.seconds} s")
    result = run_load(fleet, targets, params.seconds, params.sampling_rate, logdir)
    result.update({
        "case": case,
        "how": CASE_DOC[case],
        "approximation": case == "multi-process",
        "script": targets[0].script.strip() if case != "multi-process" else "insert into testK(info) values (null);",
        "postgresql_conf": conf,
        "guests": {g.name: {"host": g.info.host, "vcpus": len(g.info.vcpu_pins),
                            "host_cpus": list(g.host_cpus), "memory_mib": g.info.memory_mib} for g in primaries},
        "standbys": fleet.config.replication.standbys,
        **extra,
    })
    log(f"{case}: {result['aggregate_tps']} TPS, p50 {result['latency_p50_ms']} ms, p99 {result['latency_p99_ms']} ms")
    return result


@contextlib.contextmanager
def instances_up(config: FleetConfig, paths: Paths, count: int, record: dict[str, Any]) -> Iterator[Fleet]:
    """`count` fresh instances of `config` through Scaler.scale, removed again afterwards."""
    fleet = Fleet(config, paths)
    try:
        remove_all(fleet)
        t = time.monotonic()
        Scaler(fleet).scale(count, progress_logger("  "))
        record["boot_s"] = round(time.monotonic() - t, 1)
        yield fleet
    finally:
        with contextlib.suppress(Exception):
            remove_all(fleet)
        fleet.close()


MIN_REPEATS = 3  # fewer runs of a case than this cannot show its spread


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


def _range(result: dict[str, Any]) -> tuple[float, float, int]:
    """(lowest, highest, how many runs) of a case's TPS; one run: its TPS twice."""
    tps = result.get("runs_tps") or [result["aggregate_tps"]]
    return min(tps), max(tps), len(tps)


def verdict(results: dict[str, dict[str, Any]], domain_types: dict[str, str]) -> dict[str, Any]:
    """Helped, did not help, or inconclusive, from carved against single: inconclusive whenever
    the two cases' run ranges overlap, with fewer than MIN_REPEATS runs of either, and always when
    a guest ran under emulation (then the figures measured the emulator)."""
    out: dict[str, Any] = {}
    carved = results.get("carved", {}).get("aggregate_tps")
    for other in ("single", "no-replica", "multi-instance", "multi-process"):
        base = results.get(other, {}).get("aggregate_tps")
        if carved and base:
            out[f"carved_over_{other.replace('-', '_')}"] = round(carved / base, 3)
    ratio = out.get("carved_over_single")
    emulated = any(t != "kvm" for t in domain_types.values())
    if emulated:
        out["caveat"] = ("guests ran under QEMU TCG (software emulation, no usable KVM): the figures measure "
                         "the emulator, not the kernel locks carving is about; rerun on a KVM host")
    if ratio is None:
        out["word"] = "none"
        out["text"] = "no verdict: needs both the carved and the single case"
        return out
    carried = [case for case in ("carved", "single") if "carried_over_from" in results[case]]
    if carried:
        # Runs from another session were not interleaved with this one's: a drift of the machine
        # between the two sessions would show as a difference.
        out["word"] = "inconclusive"
        out["text"] = (f"inconclusive: {' and '.join(carried)} kept from an earlier run; run carved and single "
                       "together for a verdict")
        return out
    c_lo, c_hi, c_n = _range(results["carved"])
    s_lo, s_hi, s_n = _range(results["single"])
    single = results["single"]["aggregate_tps"]
    figures = (f"median {carved:.0f} TPS carved (runs {c_lo:.0f}-{c_hi:.0f}, n={c_n}) vs {single:.0f} TPS single "
               f"(runs {s_lo:.0f}-{s_hi:.0f}, n={s_n}), {(ratio - 1) * 100:+.0f}%")
    if emulated:
        out["word"], why = "inconclusive", "guests ran under emulation, so this measured the emulator"
    elif min(c_n, s_n) < MIN_REPEATS:
        out["word"], why = "inconclusive", f"fewer than {MIN_REPEATS} runs of each case cannot show the noise"
    elif c_lo <= s_hi and s_lo <= c_hi:
        out["word"], why = "inconclusive", "the runs of the two cases overlap: the difference is within the noise"
    elif c_lo > s_hi:
        out["word"], why = "helped", f"carving helped by {(ratio - 1) * 100:.0f}% on this host"
    else:
        out["word"], why = "did not help", f"carving did not help on this host: it cost {(1 - ratio) * 100:.0f}%"
    out["text"] = f"{why} ({figures})" if out["word"] != "inconclusive" else f"inconclusive: {why} ({figures})"
    return out


def host_versions() -> dict[str, str]:
    versions = {"kernel": platform.release(), "proc_version": Path("/proc/version").read_text().strip()}
    with contextlib.suppress(Exception):
        versions["pgbench"] = subprocess.run([pgbench_path(), "--version"], capture_output=True, text=True,
                                             check=False).stdout.strip()
    for server in sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres")):
        with contextlib.suppress(Exception):
            versions["postgresql_server"] = subprocess.run([server, "--version"], capture_output=True, text=True,
                                                           check=False).stdout.strip()
    qemu = shutil.which("qemu-system-x86_64")
    if qemu:
        with contextlib.suppress(Exception):
            versions["qemu"] = subprocess.run([qemu, "--version"], capture_output=True, text=True,
                                              check=False).stdout.splitlines()[0]
    return versions


def carry_over(previous: Path, doc: dict[str, Any]) -> None:
    """Keep cases of an earlier run with the same size and parameters that this run did not repeat
    (e.g. `--cases no-replica` after a full run); each case keeps its own measured_at."""
    if not previous.exists():
        return
    with contextlib.suppress(ValueError, KeyError, TypeError):
        prev = json.loads(previous.read_text())
        if prev.get("size") != doc["size"] or prev.get("params") != doc["params"]:
            return
        for case, result in prev["cases"].items():
            if case not in doc["cases"] and "error" not in result:
                doc["cases"][case] = {**result, "carried_over_from": prev.get("started_at")}


def experiment(out: Path | None, paths: Paths, cases: Sequence[str], params: ExperimentParams, hosts: int,
               hosts_file: Path | None = None, size: str = "custom", notes: Sequence[str] = (),
               charts: bool = True) -> dict[str, Any]:
    """The experiment's cases on fresh guests; writes experiment.json/.png."""
    doc: dict[str, Any] = {"part": "experiment", **run_meta(size), "notes": list(notes),
                           "params": {"instances_N": params.instances, "standbys": params.standbys,
                                      "clients_total": params.clients, "threads_total": params.threads,
                                      "seconds": params.seconds, "sampling_rate": params.sampling_rate,
                                      "repeats": params.repeats,
                                      "pg_settings": params.pg_settings,
                                      "clients": "per instance/table" if params.clients_per_target
                                      else "split over the instances/tables",
                                      "pgbench": "pgbench -M prepared -n -r -P 1 -l -f insert.sql -c C -j J -T S"},
                           "versions": {"host": host_versions(), "image": LocalImage(paths.image_dir).versions()}}
    results: dict[str, dict[str, Any]] = {}
    doc["cases"] = results
    logdir = Path(tempfile.mkdtemp(prefix="pgcarve-bench-logs-"))
    try:
        with guest_hosts(paths, hosts, hosts_file, doc) as base:
            base = with_size(base, standbys=params.standbys, memory_mib=params.memory_mib)
            probe_fleet = Fleet(base, paths)
            try:
                doc["prepare"] = prepare_hosts(probe_fleet)
                doc["versions"]["libvirt"] = probe_fleet.hosts[base.hosts[0].name].versions()
            finally:
                probe_fleet.close()
            domain_types = doc["prepare"]["domain_type"]
            v = params.vcpus or (base.instance.vcpus if hosts_file is not None else 1)
            doc["params"]["vcpus_per_carved_instance_V"] = v
            doc["params"]["vcpus_single_instance"] = v * params.instances
            # (fleet kind, config, instances, cases); every round names its fleets afresh (bench_fleet).
            plan: list[tuple[str, FleetConfig, int, list[str]]] = []
            if "carved" in cases:
                plan.append(("c", with_size(base, vcpus=v), params.instances, ["carved"]))
            together = [c for c in ("single", "multi-process") if c in cases]
            if together:
                plan.append(("s", with_size(base, vcpus=v * params.instances), 1, together))
            if "multi-instance" in cases:
                plan.append(("m", with_size(base, vcpus=v * params.instances, clusters=params.instances), 1,
                             ["multi-instance"]))
            if "no-replica" in cases:
                plan.append(("n", with_size(base, vcpus=v * params.instances, standbys=0,
                                            synchronous_commit="local"), 1, ["no-replica"]))
            runs: dict[str, list[dict[str, Any]]] = {}
            for round_no in range(params.repeats):
                # Interleaved: every case once per round, the order rotated, so a slow drift of the
                # machine (or one case always running first on cold caches) does not favour one case.
                shift = round_no % len(plan) if plan else 0
                for kind, planned, count, group in plan[shift:] + plan[:shift]:
                    config = with_size(planned, fleet=bench_fleet(kind))
                    record: dict[str, Any] = {}
                    log(f"round {round_no + 1}/{params.repeats}, {'/'.join(group)}: creating {count} instance(s) "
                        f"of {config.instance.vcpus} vCPU, {config.replication.standbys} standby(s)")
                    try:
                        with instances_up(config, paths, count, record) as fleet:
                            first = next(i.primary for i in fleet.observe() if i.primary)
                            facts = guest_facts(fleet, first)
                            doc["versions"].setdefault("guest", facts)
                            for case in group:
                                settings = dict(params.pg_settings)
                                if case == "no-replica":
                                    settings.setdefault("synchronous_commit", "local")
                                result = run_case(case, fleet, params, settings, logdir)
                                result.update(boot_s=record.get("boot_s"), fleet=config.fleet, round=round_no + 1,
                                              measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
                                runs.setdefault(case, []).append(result)
                    except Exception as exc:  # one group failing still leaves the others' results
                        for case in group:
                            runs.setdefault(case, []).append({"case": case, "how": CASE_DOC[case], "error": str(exc),
                                                              "round": round_no + 1})
                        log(f"{'/'.join(group)} failed: {exc}")
            for case, case_runs in runs.items():
                results[case] = summarize_runs(case_runs)
            if out is not None:
                carry_over(out / "experiment.json", doc)
            doc["verdict"] = verdict(results, domain_types)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    finish(doc)
    if out is not None:
        write_json(out / "experiment.json", doc)
        if charts:
            save_chart(chart_experiment, doc, out / "experiment.png")
    return doc
