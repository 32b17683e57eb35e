#!/usr/bin/env python3
"""Measure what the pgcarve collector costs, against real PostgreSQL 15 servers on 127.0.0.1.

Two measurements, printed as one JSON document on stdout (progress goes to stderr):

* ``poll``: start ``--instances`` servers (default 64; 16MB shared_buffers, max_connections 10),
  poll them at 1 Hz for ``--seconds`` (default 30) and report the collector process's CPU as %
  of one core, the p50/p99 duration of a poll round, and the CPU the servers' collector
  backends used.
* ``cost``: run pgbench (insert-only, 2 clients) on one server with and without the collector
  polling at 1 Hz, alternating ``--cost-rounds`` times, and report the TPS difference in %.

Every server is stopped by its postmaster PID on the way out, whatever happens. Run as root or
as a user that may run PostgreSQL (as root the servers run as the ``postgres`` user).

    .venv/bin/python -m bench.collector_bench --mode both
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from pgcarve.control.collector import Collector, Target
from pgcarve.control.rates import RateTracker, Snapshot
from pgcarve.postgres.pgbench import INSERT_SCRIPT

from tests.support import localpg
from tests.support.localpg import LocalServer

PGBENCH = shutil.which("pgbench") or str(localpg.PG_BIN / "pgbench")
# On top of localpg.BASE_SETTINGS (durability and autovacuum off, so A/B runs differ only by the
# collector): a small server.
SERVER_SETTINGS = ("max_connections=10",)
# Budget per idle server (16MB shared buffers, wal buffers, ~7 processes) for the memory check.
EST_MB_PER_SERVER = 64


def log(msg: str) -> None:
    """Progress on stderr, so stdout stays one JSON document."""
    print(f"[collector_bench] {msg}", file=sys.stderr, flush=True)


def _mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _cpu_seconds(pids: list[int]) -> float:
    """utime + stime of processes, from /proc/PID/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _pss_mb(pids: list[int]) -> float:
    """Proportional set size of processes (shared memory split between its users), in MB."""
    total_kb = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kb += int(line.split()[1])
                    break
        except OSError:
            continue
    return total_kb / 1024


@contextmanager
def servers(count: int, base: Path) -> Iterator[list[LocalServer]]:
    """Start ``count`` servers cloned from one template cluster; stop them all on exit."""
    started: list[LocalServer] = []
    try:
        template = LocalServer("template", base / "template", localpg.free_ports(1)[0])
        localpg.initdb(template.datadir)
        started.append(template)
        template.start(*SERVER_SETTINGS)
        template.wait_ready(60)
        with psycopg.connect(template.dsn, autocommit=True) as conn:
            conn.execute("create extension pg_stat_statements")
            conn.execute(localpg.EXPERIMENT_TABLE)
        template.stop()
        started.clear()
        for i, port in enumerate(localpg.free_ports(count)):
            srv = LocalServer(f"pg{i:03d}", base / f"pg{i:03d}", port)
            localpg.clone(template.datadir, srv.datadir)
            started.append(srv)
            srv.start(*SERVER_SETTINGS)
        deadline = time.monotonic() + 120
        for srv in started:
            srv.wait_ready(max(1.0, deadline - time.monotonic()))
        yield started
    finally:
        for srv in started:
            srv.signal_stop()
        for srv in started:
            srv.wait_stopped()


class TimedCollector(Collector):
    """Collector that records how long each poll round takes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.round_s: list[float] = []

    async def poll_once(self) -> Snapshot:
        t0 = time.perf_counter()
        snap = await super().poll_once()
        self.round_s.append(time.perf_counter() - t0)
        return snap


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


async def measure_poll(srvs: list[LocalServer], seconds: float) -> dict[str, Any]:
    targets = [Target(s.name, f"127.0.0.1:{s.port}", s.dsn) for s in srvs]
    col = TimedCollector(lambda: targets, RateTracker(), interval_s=1.0)
    try:
        await col.poll_once()  # connects every target; not part of the steady state
        connect_round_s = col.round_s[0]
        col.round_s.clear()
        backends = [pid for s in srvs for pid in s.backend_pids()]
        server_cpu0 = _cpu_seconds(backends)
        cpu0, wall0 = time.process_time(), time.monotonic()
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, stop.set)
        await col.run(stop)
        cpu1, wall1 = time.process_time(), time.monotonic()
        server_cpu1 = _cpu_seconds(backends)
        errors = dict(col.last_errors())
        # With the collector's sessions still open: they are part of what polling costs.
        pss = _pss_mb([pid for s in srvs for pid in s.process_pids()]) / len(srvs)
        last = col.tracker.history(1)[-1]
    finally:
        await col.aclose()
    wall = wall1 - wall0
    rounds = [r * 1000 for r in col.round_s]
    return {
        "instances": len(srvs),
        "seconds": round(wall, 2),
        "rounds": len(rounds),
        "collector_cpu_pct_of_one_core": round(100 * (cpu1 - cpu0) / wall, 2),
        "collector_cpu_ms_per_instance_poll": round(1000 * (cpu1 - cpu0) / max(1, len(rounds) * len(srvs)), 3),
        "round_ms_p50": round(_percentile(rounds, 50), 2),
        "round_ms_p99": round(_percentile(rounds, 99), 2),
        "round_ms_max": round(max(rounds), 2),
        "connect_round_ms": round(connect_round_s * 1000, 1),
        "server_backends_cpu_pct_of_one_core": round(100 * (server_cpu1 - server_cpu0) / wall, 2),
        "server_cpu_ms_per_instance_poll": round(
            1000 * (server_cpu1 - server_cpu0) / max(1, len(rounds) * len(srvs)), 3
        ),
        "server_pss_mb_per_instance_polled": round(pss, 1),
        "errors": errors,
        "instances_with_rate": sum(r.has_rate for r in last.instances.values()),
        "idle_aggregate_tps": round(last.aggregate_tps, 3),
        "idle_aggregate_qps": round(last.aggregate_qps, 3),
    }


async def _pgbench(srv: LocalServer, script: Path, seconds: int) -> tuple[int, float]:
    """Run pgbench; (transactions processed, tps without initial connection time)."""
    proc = await asyncio.create_subprocess_exec(
        PGBENCH, "-h", "127.0.0.1", "-p", str(srv.port), "-U", "postgres", "-M", "prepared", "-n",
        "-c", "2", "-j", "2", "-T", str(seconds), "-f", str(script), "postgres",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"pgbench failed: {err.decode(errors='replace')[-2000:]}")
    text = out.decode(errors="replace")
    count = re.search(r"number of transactions actually processed: (\d+)", text)
    tps = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", text)
    if not (count and tps):
        raise RuntimeError(f"no tps in pgbench output: {text}")
    return int(count.group(1)), float(tps.group(1))


async def _pgbench_polled(collector: Collector, srv: LocalServer, script: Path, seconds: int) -> tuple[float, float]:
    """pgbench while ``collector`` polls at 1 Hz; (pgbench tps, collector tps over the run).

    The collector's figure is the integral of its rate for ``srv`` from a baseline poll before
    the run to a poll after the backends exited (they publish counts up to 1 s late), divided
    by pgbench's run time.
    """
    stop = asyncio.Event()
    runner = asyncio.create_task(collector.run(stop))
    try:
        while not collector.tracker.history(3600):
            await asyncio.sleep(0.02)
        start = time.time()
        count, tps = await _pgbench(srv, script, seconds)
        end = time.time()
        while not [s for s in collector.tracker.history(3600) if s.at > end + 1.0]:
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await runner
    rates = [s.instances[srv.name] for s in collector.tracker.history(3600) if s.at > start]
    counted = sum(r.tps * r.interval_s for r in rates)
    return tps, counted / (count / tps)


async def measure_cost(srvs: list[LocalServer], script: Path, seconds: int, rounds: int,
                       poll_all: bool) -> dict[str, Any]:
    bench_srv = srvs[0]
    polled = srvs if poll_all else [bench_srv]
    targets = [Target(s.name, f"127.0.0.1:{s.port}", s.dsn) for s in polled]
    off: list[float] = []
    on: list[float] = []
    measured: list[float] = []
    await _pgbench(bench_srv, script, 3)  # warm-up: table and caches, not measured
    for i in range(rounds):
        # Alternate the order so drift (table growth, page cache) does not favour one side.
        for with_collector in (False, True) if i % 2 == 0 else (True, False):
            if not with_collector:
                off.append((await _pgbench(bench_srv, script, seconds))[1])
                continue
            col = Collector(lambda: targets, RateTracker(), interval_s=1.0)
            try:
                tps, seen = await _pgbench_polled(col, bench_srv, script, seconds)
            finally:
                await col.aclose()
            on.append(tps)
            measured.append(seen)
        log(f"cost round {i + 1}/{rounds}: without {off[-1]:.1f} tps, with {on[-1]:.1f} tps")
    mean_off, mean_on = statistics.fmean(off), statistics.fmean(on)
    return {
        "polled_instances": len(polled),
        "pgbench": f"-M prepared -n -c 2 -j 2 -T {seconds}, insert-only",
        "rounds": rounds,
        "tps_without_collector": [round(x, 1) for x in off],
        "tps_with_collector": [round(x, 1) for x in on],
        "mean_tps_without": round(mean_off, 1),
        "mean_tps_with": round(mean_on, 1),
        "tps_change_pct": round(100 * (mean_on - mean_off) / mean_off, 2),
        # Each round's two runs are back to back: their difference cancels slow drift.
        "paired_change_pct_median": round(
            statistics.median(100 * (b - a) / a for a, b in zip(off, on, strict=True)), 2
        ),
        "noise_stdev_pct_without": round(100 * statistics.pstdev(off) / mean_off, 2),
        "noise_stdev_pct_with": round(100 * statistics.pstdev(on) / mean_on, 2),
        "collector_tps_vs_pgbench_pct": [round(100 * (m - t) / t, 3) for m, t in zip(measured, on, strict=True)],
    }


def main() -> int:
    """Parse arguments, start the servers, run the measurements, print JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=64, help="servers to start and poll (default 64)")
    parser.add_argument("--seconds", type=float, default=30.0, help="polling time for the poll mode")
    parser.add_argument("--mode", choices=("poll", "cost", "both"), default="poll")
    parser.add_argument("--cost-seconds", type=int, default=10, help="length of each pgbench run")
    parser.add_argument("--cost-rounds", type=int, default=6, help="pgbench runs with and without")
    parser.add_argument(
        "--cost-poll",
        choices=("one", "all"),
        default="one",
        help="during the cost runs, poll only the benchmarked server or all of them",
    )
    args = parser.parse_args()
    if args.instances < 1:
        parser.error("--instances must be at least 1")
    if not localpg.available():
        parser.error(f"PostgreSQL 15 binaries not found in {localpg.PG_BIN}")

    available = _mem_available_mb()
    need = args.instances * EST_MB_PER_SERVER
    if need > available / 2:
        parser.error(
            f"{args.instances} servers need about {need} MB; only {available:.0f} MB available (keeping half free)"
        )

    # SIGTERM takes the same way out as Ctrl-C, so the servers still get stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    base = Path(tempfile.mkdtemp(prefix="pgcarve-collector-bench-"))
    result: dict[str, Any] = {
        "host_cpus": os.cpu_count(),
        "loadavg_1m_before": round(os.getloadavg()[0], 2),
        "server_settings": [*localpg.BASE_SETTINGS, *SERVER_SETTINGS],
    }
    try:
        localpg.prepare_base(base)
        script = base / "insert.sql"
        script.write_text(INSERT_SCRIPT)
        script.chmod(0o644)
        t0 = time.monotonic()
        with servers(args.instances, base) as srvs:
            result["start_s"] = round(time.monotonic() - t0, 1)
            # PSS of every server process: what the servers really use, whatever else runs here.
            result["server_pss_mb_per_instance_idle"] = round(
                _pss_mb([pid for srv in srvs for pid in srv.process_pids()]) / args.instances, 1
            )
            log(f"{len(srvs)} servers up in {result['start_s']} s")
            if args.mode in ("poll", "both"):
                log(f"polling {len(srvs)} servers at 1 Hz for {args.seconds:g} s")
                result["poll"] = asyncio.run(measure_poll(srvs, args.seconds))
            if args.mode in ("cost", "both"):
                log("measuring the collector's cost on pgbench TPS")
                result["cost"] = asyncio.run(
                    measure_cost(srvs, script, args.cost_seconds, args.cost_rounds, args.cost_poll == "all")
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
