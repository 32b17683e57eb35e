"""What every part of the benchmark shares: sizes, case names and targets, percentiles, the
/proc/stat CPU split, run metadata and JSON writing."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgcarve.advice.cases import case_fleet
from pgcarve.advice.measure import percentile

REPO_DIR = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO_DIR / "bench"
DEFAULT_OUT = BENCH_DIR / "results"
DEFAULT_STATE = Path("/var/tmp/pgcarve-bench")
BENCH_FLEET = "pgcbench"  # guests of the bench never share a name with an operator's fleet
BENCH_FLEET_PREFIX = "pgcb"  # + a case's kind + 4 hex: the experiment's and scale-out's fleets

TOKEN = "pgcarve-bench-token-0123456789abcdef"  # noqa: S105  (in-process API of a throwaway state dir)
AUTH = {"Authorization": f"Bearer {TOKEN}"}

CONTROL_PLANE = "control-plane"
SCALE_OUT = "scale-out"
# multi-process (N tables in one cluster) is the older approximation of multi-instance: run only on request.
EXPERIMENT_CASES = ("carved", "single", "multi-instance", "no-replica", "multi-process")
ALL_CASES = (CONTROL_PLANE, SCALE_OUT, *EXPERIMENT_CASES)
DEFAULT_CASES = tuple(c for c in ALL_CASES if c != "multi-process")

# Targets reported (not asserted) for the control plane.
TARGET_RECONCILE_S = 5.0
TARGET_GET_P99_MS = 20.0
TARGET_PLANNER_MS = 10.0
# The whole Scaler path 0 -> N with the guest waits stubbed (issue 32: 0 -> 1024 under 10 s).
TARGET_SCALE_UP_S = 10.0


def bench_fleet(kind: str) -> str:
    """A fleet name of its own for each group of bench guests, new on every run (see case_fleet)."""
    return case_fleet(BENCH_FLEET_PREFIX, kind)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- sizes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """Every number a size fixes; command-line options override the experiment's ones."""

    name: str
    cp_instances: int
    cp_requests: int
    cp_scaler_path: bool
    scale_hosts: int  # sandbox hosts: h0 primary, the others standby hosts
    scale_standbys: int
    scale_steps: tuple[int, ...]  # instances added per step
    exp_hosts: int
    exp_standbys: int
    exp_instances: int  # N: carved instances, vCPUs of the single instance
    clients: int  # total pgbench clients per case (split over instances / tables)
    threads: int  # total pgbench threads per case
    seconds: int
    sampling_rate: float  # of pgbench's per-transaction log
    notes: tuple[str, ...] = ()


SIZES: dict[str, Size] = {
    "smoke": Size(
        name="smoke", cp_instances=64, cp_requests=200, cp_scaler_path=True,
        scale_hosts=1, scale_standbys=0, scale_steps=(1,),
        exp_hosts=2, exp_standbys=1, exp_instances=2, clients=4, threads=2, seconds=5, sampling_rate=1.0,
        notes=("proves the harness end to end: 5 s runs, one standby, +1 without standby",),
    ),
    "small": Size(
        name="small", cp_instances=1024, cp_requests=2000, cp_scaler_path=True,
        scale_hosts=2, scale_standbys=1, scale_steps=(1, 1),
        exp_hosts=2, exp_standbys=1, exp_instances=2, clients=8, threads=2, seconds=30, sampling_rate=1.0,
        notes=(
            "a sandbox host here is this 2-CPU machine, so it holds 2 one-vCPU slots: scale-out is +1 then "
            "+1 more (not +4) with one standby, and the experiment carves N=2 instead of 8",
            "all sandbox hosts share the same 2 physical CPUs, so primaries and standbys compete for them",
        ),
    ),
    "full": Size(
        name="full", cp_instances=1024, cp_requests=2000, cp_scaler_path=True,
        scale_hosts=3, scale_standbys=2, scale_steps=(1, 4),
        exp_hosts=3, exp_standbys=2, exp_instances=8, clients=64, threads=64, seconds=120, sampling_rate=0.02,
        notes=("the experiment's sizes: real hosts from --hosts-file, 8 guests, standbys on two other hosts, "
               "64 clients, 64 threads, 120 s",),
    ),
}


# -- small measurement helpers -------------------------------------------------------------------


def summarize_ms(values_ms: Sequence[float]) -> dict[str, float]:
    return {
        "count": float(len(values_ms)),
        "p50_ms": round(percentile(values_ms, 50), 3),
        "p90_ms": round(percentile(values_ms, 90), 3),
        "p99_ms": round(percentile(values_ms, 99), 3),
        "max_ms": round(max(values_ms), 3) if values_ms else 0.0,
        "mean_ms": round(statistics.fmean(values_ms), 3) if values_ms else 0.0,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def cpu_pressure() -> float | None:
    """The share (%) of the last minute in which some runnable task waited for a CPU (Linux PSI,
    /proc/pressure/cpu "some avg60"); None where the kernel does not say. On a shared machine it
    tells how much of a wall-clock figure other work took."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = dict(part.split("=", 1) for part in first.split()[1:] if "=" in part)
    try:
        return float(fields["avg60"])
    except (KeyError, ValueError):
        return None


def run_meta(size: str) -> dict[str, Any]:
    return {
        "size": size,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                    "loadavg_at_start": loadavg(), "cpu_pressure_at_start": cpu_pressure()},
    }


def finish(doc: dict[str, Any]) -> None:
    """Stamp a part's document with when it ended, and the load average and CPU pressure then."""
    doc["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    doc["machine"]["loadavg_at_end"] = loadavg()
    doc["machine"]["cpu_pressure_at_end"] = cpu_pressure()

