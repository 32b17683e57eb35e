"""The experiment's load on several primaries at once: pgbench on every target, the host's and
each guest's CPU split over the run, what the client sessions wait on (pg_stat_activity sampled
about 10 times a second by control/waits.py, as the API does), latency percentiles from pgbench's
per-transaction log, and the PostgreSQL settings and facts each case records."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from pgcarve.advice.measure import cpu_split, host_proc_stat, mean_cpu, parse_proc_stat, percentile
from pgcarve.advice.profile import KernelProfile
from pgcarve.control.collector import Target
from pgcarve.control.fleet import Fleet, Guest
from pgcarve.control.waits import WaitBreakdown, WaitSampler
from pgcarve.postgres import admin
from pgcarve.postgres.conninfo import admin_conninfo
from pgcarve.postgres.pgbench import PgbenchResult, run_pgbench
from pgcarve.postgres.statistics import WAIT_CATEGORIES

log = logging.getLogger(__name__)

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


@contextlib.contextmanager
def waits_sampled(fleet: Fleet, targets: Sequence[LoadTarget], seconds: int,
                  rate_hz: float = 10.0) -> Iterator[dict[str, WaitBreakdown]]:
    """While the block runs, sample every target's pg_stat_activity about `rate_hz` times a second
    (a sampler on an event loop of its own, in a thread); on leaving, the dict holds each target's
    breakdown over the whole run, keyed by its label."""
    password, tls = fleet.credentials.admin_password, fleet.client_tls
    wanted = [Target(instance=t.label, host=t.guest.info.host,
                     dsn=admin_conninfo(*t.guest.endpoint, password, tls))
              for t in targets if t.guest.endpoint is not None]
    sampler = WaitSampler(lambda: wanted, rate_hz=rate_hz, max_per_s=max(100.0, rate_hz * len(wanted)),
                          window_s=seconds + 60.0)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    found: dict[str, WaitBreakdown] = {}

    def run() -> None:
        loop.run_until_complete(sampler.run(stop, reconcile_s=0.5))

    thread = threading.Thread(target=run, name="advice-waits", daemon=True)
    thread.start()
    async def read() -> dict[str, WaitBreakdown]:
        return sampler.breakdowns()

    try:
        yield found
    finally:
        # Read on the sampler's own loop, before the stop drops the feeds.
        try:
            found.update(asyncio.run_coroutine_threadsafe(read(), loop).result(30))
        except Exception as exc:  # the case's pgbench figures still count without the waits
            log.warning("could not read what sessions waited on: %r", exc)
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        if thread.is_alive():
            log.warning("the wait sampler did not stop within 30 s; left to end with the process")
        else:
            loop.close()


def waits_doc(breakdowns: Mapping[str, WaitBreakdown]) -> dict[str, Any]:
    """Per target and over all targets (observations pooled): each category's share."""
    per = {label: {"samples": b.samples, "sessions": b.sessions, "error": b.error, "summary": b.summary(),
                   "shares": {c: round(b.shares[c], 4) for c in WAIT_CATEGORIES}}
           for label, b in breakdowns.items()}
    sessions = sum(b.sessions for b in breakdowns.values())
    pooled = {c: round(sum(b.shares[c] * b.sessions for b in breakdowns.values()) / sessions, 4) if sessions else 0.0
              for c in WAIT_CATEGORIES}
    return {"per_target": per, "shares": pooled, "sessions": sessions}


# The experiment's symptom: most client time waits for the standby while the CPUs sit idle and
# the kernel's share of busy time is at least user space's (kernel mutexes behind epoll_ctl).
SYMPTOM_SYNCREP_SHARE = 0.5
SYMPTOM_IDLE_SHARE = 0.3


def symptom(waits: Mapping[str, Any], cpu: Mapping[str, float] | None) -> dict[str, Any]:
    """Whether the experiment's symptom shows in one case: `waits` from waits_doc, `cpu` the
    primaries' CPU split (their guests' mean, else the host's)."""
    syncrep = float(waits.get("shares", {}).get("SyncRep", 0.0))
    if not waits.get("sessions") or not cpu:
        return {"shows": None, "text": "not measured: no wait samples or no CPU split"}
    idle, user, system = cpu["idle"], cpu["user"], cpu["system"]
    # (the sign as the experiment saw it, the same sign absent, figures, seen here)
    checks = [
        ("commits wait on the standby", "commits do not mostly wait on the standby",
         f"{syncrep * 100:.0f}% of client time in SyncRep, threshold {SYMPTOM_SYNCREP_SHARE * 100:.0f}%",
         syncrep >= SYMPTOM_SYNCREP_SHARE),
        ("CPUs sit idle", "CPUs are busy", f"{idle * 100:.0f}% idle, threshold {SYMPTOM_IDLE_SHARE * 100:.0f}%",
         idle >= SYMPTOM_IDLE_SHARE),
        ("kernel time is high", "kernel time is below user time",
         f"{system * 100:.0f}% system vs {user * 100:.0f}% user", 0 < system >= user),
    ]
    shows = all(seen for *_, seen in checks)
    if shows:
        text = "the experiment's symptom shows: " + "; ".join(f"{sign} ({figures})" for sign, _, figures, _ in checks)
    else:
        text = "the experiment's symptom does not show: " + "; ".join(
            f"{absent} ({figures})" for _, absent, figures, seen in checks if not seen)
    return {"shows": shows, "text": text, "syncrep_share": round(syncrep, 4), "cpu": dict(cpu)}



def run_load(fleet: Fleet, targets: Sequence[LoadTarget], seconds: int, sampling_rate: float,
             logdir: Path, profile_kernel: bool = False) -> dict[str, Any]:
    """pgbench on every target at once; host and guest CPU split over the run; latency logs; with
    `profile_kernel`, the host kernel's hottest symbols over the run (advice/profile.py)."""
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
    profile = KernelProfile(seconds) if profile_kernel else None
    try:
        with waits_sampled(fleet, targets, seconds) as breakdowns, \
                ThreadPoolExecutor(max_workers=len(targets)) as pool:
            results = list(pool.map(one, targets))
    finally:
        kernel = profile.result() if profile is not None else None
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
        "waits": (waits := waits_doc(breakdowns)),
        "symptom": symptom(waits, mean_cpu(list(guest_cpu.values())) or cpu_split(host_before, host_after)),
        "per_instance": per_target,
        **({"kernel_profile": kernel} if kernel is not None else {}),
    }
