"""The experiment's load on several primaries at once: pgbench on every target, the host's and
each guest's CPU split over the run, latency percentiles from pgbench's per-transaction log, and
the PostgreSQL settings and facts each case records."""

from __future__ import annotations

import glob
import re
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from pgcarve.control.fleet import Fleet, Guest
from pgcarve.postgres import admin
from pgcarve.postgres.pgbench import PgbenchResult, run_pgbench

from bench.harness import cpu_split, host_proc_stat, parse_proc_stat, percentile

PROGRESS_RE = re.compile(r"^progress: ([0-9.]+) s, ([0-9.]+) tps, lat ([0-9.]+) ms", re.M)
REPORTED_SETTINGS = ("synchronous_commit", "synchronous_standby_names", "fsync", "full_page_writes",
                     "shared_buffers", "wal_buffers", "max_wal_size", "max_wal_senders", "max_connections",
                     "wal_level")


@dataclass(frozen=True)
class LoadTarget:
    guest: Guest
    label: str
    script: str
    clients: int
    jobs: int


def apply_settings(fleet: Fleet, guest: Guest, settings: Mapping[str, str]) -> dict[str, Any]:
    """ALTER SYSTEM + reload for settings that need no restart; report the rest as not applied."""
    with fleet.connect(guest) as conn:
        change = admin.alter_settings(conn, settings)
        effective = admin.effective_settings(conn, [*REPORTED_SETTINGS, *settings])
    return {"applied": change.applied, "not_applied": change.not_applied, "effective": effective}


def guest_facts(fleet: Fleet, guest: Guest) -> dict[str, str]:
    """The guest's PostgreSQL version and kernel (/proc/version, read by the server)."""
    facts: dict[str, str] = {}
    with fleet.connect(guest) as conn:
        facts["postgresql"] = admin.server_version(conn)
        try:
            facts["kernel"] = admin.read_server_file(conn, "/proc/version", 4096).strip()
        except psycopg.Error as exc:
            facts["kernel"] = f"unavailable: {exc}"
    return facts


def guest_proc_stat(fleet: Fleet, guest: Guest) -> dict[str, int] | None:
    """The guest kernel's aggregate CPU counters, or None if they cannot be read."""
    try:
        with fleet.connect(guest) as conn:
            text = admin.read_server_file(conn, "/proc/stat")
        return parse_proc_stat(text) if text else None
    except Exception:
        return None


def read_latencies(prefix: str) -> list[float]:
    """Per-transaction latencies (ms) from pgbench --log files PREFIX.PID[.N]."""
    values: list[float] = []
    for path in glob.glob(glob.escape(prefix) + ".*"):
        with open(path) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3 and parts[2].isdigit():
                    values.append(int(parts[2]) / 1000.0)
    return values


def run_load(fleet: Fleet, targets: Sequence[LoadTarget], seconds: int, sampling_rate: float,
             logdir: Path) -> dict[str, Any]:
    """pgbench on every target at once; host and guest CPU split over the run; latency logs."""
    guests = {t.guest.name: t.guest for t in targets}
    guest_before = {name: guest_proc_stat(fleet, g) for name, g in guests.items()}
    host_before = host_proc_stat()
    prefixes = {t.label: str(logdir / t.label) for t in targets}

    def one(target: LoadTarget) -> PgbenchResult:
        extra = ("-P", "1", "-l", f"--log-prefix={prefixes[target.label]}", f"--sampling-rate={sampling_rate}")
        return run_pgbench(target.guest.name, target.guest.endpoint, fleet.credentials.admin_password,
                           target.clients, target.jobs, seconds, script=target.script,
                           extra_args=extra, tls=fleet.client_tls)

    t = time.time()
    with ThreadPoolExecutor(max_workers=len(targets)) as pool:
        results = list(pool.map(one, targets))
    wall = time.time() - t
    host_after = host_proc_stat()
    guest_after = {name: guest_proc_stat(fleet, g) for name, g in guests.items()}
    per_target: list[dict[str, Any]] = []
    all_lat: list[float] = []
    for target, res in zip(targets, results, strict=True):
        lat = read_latencies(prefixes[target.label])
        all_lat.extend(lat)
        per_target.append({
            "label": target.label, "instance": target.guest.name, "clients": target.clients, "jobs": target.jobs,
            "tps": round(res.tps, 1), "transactions": res.transactions, "failed": res.failed,
            "latency_avg_ms": res.latency_avg_ms,
            "latency_p50_ms": round(percentile(lat, 50), 3), "latency_p99_ms": round(percentile(lat, 99), 3),
            "latency_samples": len(lat),
            "progress_tps": [float(m.group(2)) for m in PROGRESS_RE.finditer(res.output)],
        })
    guest_cpu = {}
    for name in guests:
        b, a = guest_before[name], guest_after[name]
        guest_cpu[name] = cpu_split(b, a) if b and a else None
    return {
        "aggregate_tps": round(sum(p["tps"] for p in per_target), 1),
        "latency_p50_ms": round(percentile(all_lat, 50), 3),
        "latency_p99_ms": round(percentile(all_lat, 99), 3),
        "latency_samples": len(all_lat),
        "wall_s": round(wall, 2),
        "host_cpu": cpu_split(host_before, host_after),
        "guest_cpu": guest_cpu,
        "per_instance": per_target,
    }
